import os

# Tests never reach a hub and keep each process to one thread (CI has 2 cores).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
