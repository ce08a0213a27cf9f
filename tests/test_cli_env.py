"""``trl-diffusion env``: TRL's ``trl env`` report plus this package's version, the optional packages it reads and the
attention kernel ``attention_backend="auto"`` runs on this machine, for a bug report."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import torch
import trl
from test_cli import one_line_error

import trl_diffusion
from trl_diffusion import cli
from trl_diffusion.cli import diffusion_environment, main


def test_env_prints_trls_report_and_ours(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"- TRL version: {trl.__version__}" in out and "Copy-paste the following information" in out
    assert f"- trl_diffusion version: {trl_diffusion.__version__}" in out
    try:
        flash = version("flash-attn")
    except PackageNotFoundError:
        flash = "not installed"
    assert f"- flash-attn version: {flash}" in out and f"- math-verify version: {version('math-verify')}" in out
    header, listed = out.strip().split("\n\n", 1)
    assert "\n\n" not in listed and listed.endswith(")")  # one list, ours last
    if not torch.cuda.is_available():
        assert "- attention_backend='auto' on cpu (head_dim 128, bfloat16): sdpa (flex attention is compiled only " \
               "on CUDA" in out


def test_env_says_what_auto_picks_on_cuda(monkeypatch):
    """On a CUDA machine: compiled flex attention for the released models' head size in bfloat16, SDPA with the
    reason for the embedded model (its float32 head_dim-32 flex kernel failed to compile)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    report = diffusion_environment()
    assert report["attention_backend='auto' on cuda (head_dim 128, bfloat16)"] == "flex"
    embedded = report["attention_backend='auto' on cuda (embedded model: head_dim 32, float32)"]
    assert embedded.startswith("sdpa (compiled flex attention is verified for head_dim in (64, 128, 256)")


def test_env_takes_no_arguments(capsys):
    assert main(["env", "--model_name_or_path", "x"]) == 2
    assert one_line_error(capsys, "trl-diffusion env") == "trl-diffusion env: error: takes no arguments, got " \
        "--model_name_or_path x"
    assert main(["env", "--help"]) == 0 and "bug report" in capsys.readouterr().out
    assert main(["--help"]) == 0 and f"  env       {cli._env.__doc__}" in capsys.readouterr().out
