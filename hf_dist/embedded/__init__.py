"""The embedded default: a tiny Llama and a toy instruction task on which learning shows in minutes.

``model`` sizes the tiny Llama, ``task`` generates the string-operation examples and ``task_eval`` scores
them. Nothing is downloaded; it is what ``make demo`` and a recipe without ``--model_name_or_path`` train.
"""
