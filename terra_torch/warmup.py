"""Fill a convolution profile record ahead of training: `python -m terra_torch.warmup`.

One forward and backward pass per batch size profiles every convolution of the model (forward,
backward-data, backward-filter) and writes the record, so that the training job starts without
profiling and without the profiling memory spike. Run it once per GPU type, e.g. in the image
build or before a sweep. See docs/PROFILE_RECORD.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence, TextIO

import torch

from terra_torch import profile

DESCRIPTION = """\
Profile every convolution of a model once (forward + backward) and write the cuDNN engine configurations to
a profile record (JSON). Later runs that enable the record (terra_torch.profile.enable(path) or
TERRA_PROFILE_RECORD=path) reuse the choices for every batch size, without profiling.
"""

EPILOG = """\
examples:
  python -m terra_torch.warmup --model torchvision.models:resnet50 \\
      --input-shape 32,3,224,224 --record ~/.cache/terra/resnet50-h200.json
  python -m terra_torch.warmup --model mypkg.nets:build --input-shape 8,3,299,299 \\
      --record r.json --batch-sizes 8,64 --workspace-cap 2GiB --dtype float16 --channels-last

exit status: 0 done; 1 cannot run here (no CUDA device, model raised); 2 bad arguments.
"""


def _positive_ints(text: str, what: str, min_len: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be comma-separated integers, got {text!r}") from None
    if len(values) < min_len or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"{what} needs at least {min_len} positive integers separated by commas, got {text!r}")
    return values


def _input_shape(text: str) -> list[int]:
    return _positive_ints(text, "--input-shape (batch,channels,spatial...)", min_len=3)


def _batch_sizes(text: str) -> list[int]:
    return _positive_ints(text, "--batch-sizes")


def _model_spec(text: str) -> str:
    module, sep, attr = text.partition(":")
    if not sep or not module or not attr:
        raise argparse.ArgumentTypeError(f"--model must look like 'package.module:factory', got {text!r}")
    return text


def _byte_size(text: str) -> int:
    try:
        return profile.parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m terra_torch.warmup", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=_model_spec, metavar="MODULE:FACTORY",
                   help="importable callable that returns the torch.nn.Module to profile, called "
                        "without arguments (e.g. torchvision.models:resnet50)")
    p.add_argument("--input-shape", required=True, type=_input_shape, metavar="N,C,H,W",
                   help="shape of one input batch, batch first (e.g. 8,3,224,224); the batch "
                        "size is the default of --batch-sizes")
    p.add_argument("--record", required=True, metavar="PATH",
                   help="the profile record (JSON) to create or extend; entries already there "
                        "are reused, not profiled again")
    p.add_argument("--batch-sizes", type=_batch_sizes, metavar="B1,B2,...",
                   help="run one pass per batch size (default: the batch of --input-shape). One "
                        "size is enough: the record serves every batch size; list more only to "
                        "check that they run")
    p.add_argument("--workspace-cap", type=_byte_size, metavar="BYTES",
                   help="largest cuDNN workspace any profiled engine configuration may use, e.g. 2GiB or "
                        "512MB (default: $TERRA_PROFILE_WORKSPACE_CAP, else no cap). Algorithms "
                        "needing more are neither timed nor recorded, so profiling cannot "
                        "overshoot memory")
    p.add_argument("--device", metavar="DEVICE",
                   help="torch device to profile on (default: cuda; cpu with --fake-provider)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="parameter and input dtype; part of the record key (default: float32)")
    p.add_argument("--channels-last", action="store_true",
                   help="use the channels_last memory format; part of the record key")
    p.add_argument("--eval", action="store_true",
                   help="forward only, in eval mode (inference services); default trains: "
                        "forward and backward")
    p.add_argument("--fake-provider", action="store_true",
                   help="for tests only: run on CPU with a scripted fake provider instead of cuDNN "
                        "(the record then belongs to a fake device and is useless for training)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, only the summary")
    return p


class Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, a line per batch size
    otherwise (logs and CI keep readable output)."""

    def __init__(self, total: int, label: str, stream: TextIO = sys.stderr, quiet: bool = False,
                 width: int = 30) -> None:
        self.total, self.label, self.stream, self.quiet, self.width = max(total, 1), label, stream, quiet, width
        self.done = 0
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def _line(self) -> str:
        filled = self.width * min(self.done, self.total) // self.total
        return f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {min(self.done, self.total)}/{self.total} convolutions"

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.tty and not self.quiet:
            self.stream.write("\r" + self._line())
            self.stream.flush()

    def finish(self, suffix: str = "") -> None:
        self.done = self.total
        if not self.quiet:
            self.stream.write(("\r" if self.tty else "") + self._line() + suffix + "\n")
            self.stream.flush()


def load_factory(spec: str) -> Callable[[], Any]:
    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{spec} is not callable")
    return target


def _conv_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    nn = torch.nn
    kinds = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
    return [m for m in model.modules() if isinstance(m, kinds)]


def _loss_of(output: Any) -> Any:
    """Sum of every floating tensor in the output (Inception returns aux logits too)."""
    if isinstance(output, torch.Tensor):
        return output.float().sum() if output.is_floating_point() else None
    parts = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else \
        getattr(output, "_asdict", lambda: {})().values()
    losses = [loss for loss in (_loss_of(o) for o in parts) if loss is not None]
    return sum(losses) if losses else None


def _fail(message: str) -> int:
    print(f"terra_torch.warmup: error: {message}", file=sys.stderr)
    return 1


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    device = args.device or ("cpu" if args.fake_provider else "cuda")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        parser.error(f"--device: {e}")
    if args.fake_provider and device.type != "cpu":
        parser.error("--fake-provider runs on --device cpu only")
    if not args.fake_provider:
        if device.type != "cuda":
            parser.error(f"--device {device}: profiling cuDNN convolutions needs a CUDA device "
                         "(use --fake-provider for a CPU test run)")
        if not torch.cuda.is_available():
            return _fail("profiling convolution algorithms needs a CUDA device, and "
                         f"torch.cuda.is_available() is False here (torch {torch.__version__}). "
                         "Run this on the GPU machine that will train (the record is per GPU "
                         "type), or pass --fake-provider to test the script on CPU.")
        if not profile._P.with_cuda:
            return _fail("this build of terra_torch has no CUDA/cuDNN support, so it cannot profile "
                         "convolutions; rebuild it on a machine with the CUDA toolkit and a CUDA "
                         "build of torch (pip install -e . --no-build-isolation).")

    try:
        factory = load_factory(args.model)
    except (ImportError, AttributeError, TypeError) as e:
        parser.error(f"--model {args.model}: {e}")
    try:
        model = factory()
    except Exception as e:  # the user's code: report, don't trace
        return _fail(f"{args.model}() raised {type(e).__name__}: {e}")
    if not isinstance(model, torch.nn.Module):
        parser.error(f"--model {args.model} returned {type(model).__name__}, not a torch.nn.Module")

    dtype = getattr(torch, args.dtype)
    shape = args.input_shape
    batch_sizes = args.batch_sizes or [shape[0]]
    memory_format = None
    if args.channels_last:
        memory_format = {4: torch.channels_last, 5: torch.channels_last_3d}.get(len(shape))
        if memory_format is None:
            parser.error("--channels-last needs a 4-d or 5-d --input-shape")
    model = model.to(device=device, dtype=dtype)
    if memory_format is not None:
        model = model.to(memory_format=memory_format)
    model.train(not args.eval)

    convs = _conv_modules(model)
    if not convs:
        print("terra_torch.warmup: warning: the model has no convolution modules; the record only "
              "gets convolutions called functionally", file=sys.stderr)
    passes = 1 if args.eval else 2
    provider = profile.FakeProvider() if args.fake_provider else None
    try:
        profile.enable(args.record, args.workspace_cap, provider=provider,
                       device=device.index if device.type == "cuda" else None)
    except (RuntimeError, ValueError, OSError) as e:
        return _fail(str(e))
    if not profile.is_enabled():  # enable() only warns where the record cannot be used
        return _fail("the profile record could not be enabled (see the warning above)")

    progress: Optional[Progress] = None

    # Counts convolutions as they run. Backward is counted with a hook on the output tensor, not
    # a module backward hook: those break models that apply an in-place ReLU to a conv's output.
    def on_forward(_module: Any, _inputs: Any, output: Any) -> None:
        if progress is not None:
            progress.advance()
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda _grad: progress.advance())

    handles = [m.register_forward_hook(on_forward) for m in convs]
    started = time.perf_counter()
    try:
        for batch in batch_sizes:
            progress = Progress(len(convs) * passes, f"batch {batch:>4}", quiet=args.quiet)
            x = torch.randn([batch, *shape[1:]], device=device, dtype=dtype)
            if memory_format is not None:
                x = x.contiguous(memory_format=memory_format)
            t0 = time.perf_counter()
            with torch.set_grad_enabled(not args.eval):
                loss = _loss_of(model(x))
                if not args.eval and loss is not None:
                    loss.backward()
                    model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            progress.finish(f"  {time.perf_counter() - t0:.2f} s")
    except torch.cuda.OutOfMemoryError as e:
        return _fail(f"out of GPU memory at batch {batch}: {e}; lower --batch-sizes or --workspace-cap")
    finally:
        for h in handles:
            h.remove()
        counters = profile.stats()
        entries = len(profile.entries())
        profile.disable()

    print(f"terra_torch.warmup: {args.record}: {entries} entries; this run profiled {counters['profiles']}, "
          f"reused {counters['record_hits']}, fell back {counters['fallbacks']} times, "
          f"{counters['failures']} failures; {time.perf_counter() - started:.1f} s")
    if counters["failures"]:
        print("terra_torch.warmup: warning: some convolutions could not be profiled within the "
              "workspace cap; they run with PyTorch's default choice", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.record.strip():
        parser.error("--record must name a file")
    args.record = os.path.expanduser(args.record)
    return run(args, parser)


if __name__ == "__main__":
    sys.exit(main())
