import subprocess
import sys


def test_import_is_lazy():
    """`import hf_dist` must not pull in deepspeed, transformers models or torch.distributed work."""
    code = (
        "import sys, hf_dist; bad = [m for m in ('deepspeed', 'transformers', 'peft') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_unknown_attribute_raises():
    import hf_dist

    try:
        hf_dist.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_cli_help_lists_examples():
    out = subprocess.run(
        [sys.executable, "-m", "hf_dist", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "examples:" in out and "hf-dist plan" in out


def test_every_public_name_resolves():
    import hf_dist

    for name in hf_dist.__all__:
        assert getattr(hf_dist, name) is not None, name


def test_every_subcommand_has_help_with_examples():
    from hf_dist.cli.main import SUBCOMMANDS

    for name in SUBCOMMANDS:
        out = subprocess.run(
            [sys.executable, "-m", "hf_dist", name, "--help"], capture_output=True, text=True, check=True
        ).stdout
        assert "example" in out.lower(), f"hf-dist {name} --help has no examples"


def test_callbacks_are_reachable_from_the_top_level():
    code = (
        "import sys, hf_dist; from hf_dist.callbacks import attach; "
        "assert hf_dist.attach is attach and hf_dist.callbacks.attach is attach; "
        "assert 'callbacks' in dir(hf_dist) and 'attach' in dir(hf_dist); "
        "print([m for m in ('deepspeed', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"  # reaching them stays lazy


def test_estimate_memory_takes_an_integral_float_count():
    import pytest

    import hf_dist

    assert hf_dist.estimate_memory(7.5e9, "ddp", 8) == hf_dist.estimate_memory(7_500_000_000, "ddp", 8)
    with pytest.raises(ValueError, match=r"whole number, got 7500000000\.5 \(not integral\)"):
        hf_dist.estimate_memory(7.5e9 + 0.5, "ddp", 8)
