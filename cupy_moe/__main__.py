"""Command line: `python -m cupy_moe demo | inspect PATH | bench [ARGS] | tune`.

A problem prints one line on stderr and exits with status 2; `--debug` (before the command) or CUPY_MOE_DEBUG set
to anything but 0, false, no, off or empty shows the traceback instead. Arguments and paths are checked before
anything looks for a GPU. Long steps show a progress bar on stderr when stderr is a terminal, and nothing when it
is piped or redirected. A closed pipe on stdout (`... | head`) ends the command quietly with status 141, as a
shell reports a process ended by SIGPIPE; SIGINT, SIGTERM and SIGHUP end it with 128 + the signal's number, after
removing its temporary files.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ._inspect_text import finite_json, format_inspection
from ._progress import Steps, progress_bar, steps
from ._xp import INSTALL_HINT
from .models import BENCHMARK_MODELS, MODELS, get_model

PROG = "python -m cupy_moe"
DEBUG_ENV = "CUPY_MOE_DEBUG"
DEBUG_OFF = ("", "0", "false", "no", "off")  # values of DEBUG_ENV that leave debugging off (any case)
MAX_TOKENS = 1 << 20  # the largest token count M the demo and tune take
CHECK_BAR = 1e-3  # largest relative L2 error of the demo's output against the float64 reference that passes
# float64 expert weights the demo's NumPy layer run aims to hold at once: it runs as many tokens a call as keep the
# experts they touch under this, and at least one token (whose top-k experts may need more on the largest models)
HOST_FLOAT64_BYTES = 2 << 30
SIGPIPE_STATUS = 141  # what a shell reports for a process ended by SIGPIPE: the exit status of a closed stdout
BENCHMARK = Path("benchmarks") / "bench_gemm.py"


class CliError(Exception):
    """A problem the user can fix: printed as one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported like every other error: one line on stderr, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


# --------------------------------------------------------------------------------------------- GPU


def gpu_problem() -> str | None:
    """None when CuPy sees a CUDA GPU, else why not, in words: what to install when CuPy is missing; the driver's
    answer when CuPy is there (installing it again would not help)."""
    from . import _xp
    if _xp.cupy is None:
        return f"CuPy is not installed; install cupy_moe with its CUDA extra, {INSTALL_HINT}"
    if _xp.gpu_available():
        return None
    try:
        _xp.cupy.cuda.runtime.getDeviceCount()
        why = "0 CUDA devices"
    except Exception as exc:  # no driver, or one older than CuPy's CUDA runtime
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return (f"no CUDA GPU found (CUDA says: {why}); CuPy {_xp.cupy.__version__} is installed, and needs an NVIDIA "
            "GPU with its driver")


def require_gpu():
    """The cupy module, or a CliError that says why there is no GPU to use."""
    problem = gpu_problem()
    if problem:
        raise CliError(problem)
    import cupy
    return cupy


# --------------------------------------------------------------------------------------------- argument types


def whole_number(text: str, low: int, high: int | None = None) -> int:
    """int(text) in [low, high] (no upper bound when high is None), else an ArgumentTypeError that says so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {value}")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"expected a whole number <= {high:,}, got {value:,}")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1)


def non_negative_int(text: str) -> int:
    return whole_number(text, 0)


def token_count(text: str) -> int:
    """A token count M: a whole number in [1, MAX_TOKENS]."""
    return whole_number(text, 1, MAX_TOKENS)


@contextmanager
def argument_error(label: str):
    """Inside an argparse type: a ValueError of the library ("model: expected ..., got ...") becomes the argument's
    error, without its `label: `, as argparse names the option instead."""
    try:
        yield
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{label}: ")) from None


def model_name(text: str) -> str:
    """A name of models.MODELS in any case -> its spelling in the table."""
    with argument_error("model"):
        return get_model(text).name


def model_list(text: str) -> list[str]:
    """Comma-separated model names -> their table spellings, each once, in the order given."""
    names = [model_name(part.strip()) for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected at least one model name")
    return list(dict.fromkeys(names))


def token_counts(text: str) -> tuple[int, ...]:
    """Comma-separated token counts (each in [1, MAX_TOKENS]) -> each once, in the order given."""
    return tuple(dict.fromkeys(token_count(part.strip()) for part in text.split(",")))


def non_empty_path(text: str) -> Path:
    """A path; not empty, which Path would take as the current folder."""
    if not text:
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return Path(text)


# --------------------------------------------------------------------------------------------- demo


def rel_l2(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def describe(shape, tokens: int) -> str:
    shared = f", shared experts of intermediate {shape.shared_intermediate}" if shape.shared_intermediate else ""
    return (f"{shape.name} layer ({shape.family} naming): hidden size {shape.hidden}, expert intermediate size "
            f"{shape.intermediate}, {shape.num_experts} experts, top-{shape.top_k} routing{shared}; GPTQ 4-bit, "
            f"group size {shape.group_size}; {tokens} tokens")


def verdict(err: float, what: str) -> str:
    return (f"check: {what}: relative L2 error {err:.2e}, at most {CHECK_BAR:.0e} passes: "
            f"{'PASS' if err <= CHECK_BAR else 'FAIL'}")


def host_chunk(shape) -> int:
    """Tokens per call of the NumPy layer path: each GEMM phase dequantizes every expert a call's tokens touch to
    float64 (8 bytes a weight, 2*H*I weights in the larger phase), so a call takes as many tokens as keep that under
    HOST_FLOAT64_BYTES, and at least one."""
    per_token = shape.top_k * 8 * 2 * shape.hidden * shape.intermediate
    return max(1, HOST_FLOAT64_BYTES // per_token)


def cpu_footprint(shape) -> tuple[int, int]:
    """(bytes of the demo's checkpoint on disk, peak bytes of memory of its NumPy run and check), estimated: the
    packed layer (4-bit weights with float16 scales and 4-bit zeros per group, as written), held in memory too,
    plus the float64 experts of one call of the layer (host_chunk) or of the float64 check (one expert at a time),
    plus a float32 copy of one expert on its way to float64."""
    from .testing import shared_intermediate_written
    h, i, e = shape.hidden, shape.intermediate, shape.num_experts
    i_s = shared_intermediate_written(shape.family, i, shape.shared_intermediate or None)
    weights = 3 * h * (e * i + i_s)
    disk = weights // 2 + weights * 5 // (2 * shape.group_size) + h * e * 2  # + the float16 router
    experts = min(e, host_chunk(shape) * shape.top_k)
    float64 = max(experts * 2 * h * i, 3 * h * max(i, i_s)) * 8
    return disk, disk + float64 + 3 * h * max(i, i_s) * 4


def gb(nbytes) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.0f} MB"


def in_chunks(fn, x, chunk: int, step: Steps, what: str) -> np.ndarray:
    """fn(x) computed `chunk` rows at a time (the rows of a MoE layer are independent), reporting each chunk."""
    out = []
    for start in range(0, x.shape[0], chunk):
        step.say(f"{what}: tokens {start + 1}-{min(start + chunk, x.shape[0])} of {x.shape[0]}")
        out.append(np.asarray(fn(x[start:start + chunk])))
    return np.concatenate(out)


def write_demo_checkpoint(folder, shape, seed):
    """The demo's checkpoint, written into a temporary folder inside `folder` and moved up once complete: a demo
    stopped while writing (a signal, a full disk) leaves `--dir` as empty as it found it, so that it can run again."""
    from .testing import write_checkpoint
    with tempfile.TemporaryDirectory(prefix=".partial_", dir=folder) as part:
        write_checkpoint(part, family=shape.family, num_layers=1, hidden=shape.hidden,
                         intermediate=shape.intermediate, num_experts=shape.num_experts, top_k=shape.top_k,
                         group_size=shape.group_size, shared_intermediate=shape.shared_intermediate or None,
                         return_weights=False, seed=seed)
        for written in Path(part).iterdir():
            os.replace(written, folder / written.name)


def demo_cpu(args, folder, shape, why: str) -> int:
    from . import MoELayer
    from .testing import dense_layer_output
    check = min(args.tokens, args.check_tokens)
    chunk = host_chunk(shape)
    print(describe(shape, args.tokens) + "; NumPy reference path")
    disk, peak = cpu_footprint(shape)
    print(f"{why} Estimated: about {gb(disk)} on disk, about {gb(peak)} of memory at the peak", flush=True)
    t0 = time.perf_counter()
    with steps(4) as step:
        step.next("writing the checkpoint (random weights, GPTQ-quantized)")
        write_demo_checkpoint(folder, shape, args.seed)
        step.next("loading layer 0")
        layer = MoELayer.from_checkpoint(folder, 0, device=False)
        step.next("running the layer")
        x = np.random.default_rng(args.seed).standard_normal((args.tokens, shape.hidden)).astype(np.float16)
        y = in_chunks(layer, x, chunk, step, "running the layer")
        step.next("checking")
        ref = in_chunks(lambda rows: dense_layer_output(layer, rows), x[:check], chunk, step,
                        "checking against float64 loops")
        err = rel_l2(y[:check], ref)
    print(verdict(err, f"{check} tokens against float64 loops over the dequantized weights"))
    print(f"took {time.perf_counter() - t0:.1f} s. {why}")
    return 0 if err <= CHECK_BAR else 1


def check_new_folder(path: Path, option: str) -> Path:
    """`path` as a folder to write into: created when missing; a CliError naming `option` when it is a file, is a
    folder that holds anything, or cannot be created."""
    if path.exists() and not path.is_dir():
        raise CliError(f"argument {option}: expected a new or empty folder, got a file: {path}")
    if path.is_dir():
        entries = sum(1 for _ in path.iterdir())
        if entries:
            raise CliError(f"argument {option}: expected a new or empty folder, got {path}, which holds "
                           f"{entries} {'entry' if entries == 1 else 'entries'} (the demo writes *.json and "
                           "*.safetensors files there, replacing any)")
        return path
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        raise CliError(f"argument {option}: expected a folder that can be created, got {path} "
                       f"({exc.strerror or type(exc).__name__})") from exc
    return path



def demo_gpu(args, folder, shape, cp) -> int:
    from . import MoELayer
    from .timing import copy_bandwidth, event_time
    print(describe(shape, args.tokens) + "; GPU path")
    check = min(args.tokens, args.check_tokens)
    with steps(5) as step:
        step.next("writing the checkpoint (random weights, GPTQ-quantized)")
        t0 = time.perf_counter()
        write_demo_checkpoint(folder, shape, args.seed)
        t_write = time.perf_counter() - t0
        step.next("loading layer 0 onto the GPU")
        layer = MoELayer.from_checkpoint(folder, 0, device=True)
        w = layer.weights
        step.next("running the layer (the first call compiles the kernels)")
        x_host = np.random.default_rng(args.seed).standard_normal((args.tokens, w.hidden_size)).astype(np.float16)
        x = cp.asarray(x_host)
        y = cp.asnumpy(layer(x)[:check])
        step.next("checking")
        ref = in_chunks(MoELayer.from_checkpoint(folder, 0, device=False), x_host[:check], host_chunk(shape), step,
                        "checking against the NumPy reference")
        err = rel_l2(y, ref)
        step.next(f"timing {args.reps} CUDA graph replays")
        captured = layer.capture(x)
        seconds = event_time(lambda i: captured.replay(), reps=args.reps, stream=captured.stream)
        _, ids = layer.route(x)
        touched = int(cp.unique(ids).size)
        expert_bytes = (w.w13.nbytes + w.w2.nbytes) / w.num_experts
        shared_bytes = 0 if w.shared is None else sum(
            getattr(p, "nbytes", 0) for p in (w.shared.gate_up, w.shared.down))
        floor_bytes = touched * expert_bytes + shared_bytes + 2 * x.nbytes
        bandwidth = copy_bandwidth()
    print(f"packed layer {w.nbytes / 2**20:.0f} MiB (checkpoint written in {t_write:.1f} s)")
    print(verdict(err, f"{check} tokens against the NumPy reference"))
    floor = floor_bytes / bandwidth
    print(f"time per layer call, {args.tokens} tokens (CUDA graph replay, median of {args.reps}): "
          f"{seconds * 1e6:.1f} us")
    print(f"memory floor: {floor * 1e6:.1f} us to read {floor_bytes / 2**20:.0f} MiB ({touched} experts touched) at "
          f"the {bandwidth / 1e12:.2f} TB/s copy bandwidth measured now; this call runs at {floor / seconds:.0%} "
          "of that floor")
    return 0 if err <= CHECK_BAR else 1


def demo(args) -> int:
    folder = check_new_folder(args.dir, "--dir") if args.dir is not None else None
    problem = gpu_problem()
    on_gpu = problem is None and not args.cpu
    shape = get_model(args.model or ("Mixtral-8x7B" if on_gpu else "tiny"))
    with tempfile.TemporaryDirectory(prefix="cupy_moe_demo_") as tmp:
        if folder is not None:
            print(f"writing a synthetic GPTQ MoE checkpoint to {folder} (kept)")
        else:
            folder = Path(tmp)
            print("writing a synthetic GPTQ MoE checkpoint to a temporary folder (--dir DIR keeps it)")
        if on_gpu:
            import cupy
            return demo_gpu(args, folder, shape, cupy)
        why = ("NumPy path as asked (--cpu)." if args.cpu else
               f"The GPU path did not run: {problem}.")
        return demo_cpu(args, folder, shape, why)


# --------------------------------------------------------------------------------------------- inspect


def inspect(args) -> int:
    from .checkpoint import inspect_checkpoint
    path = args.path
    if not path.exists():
        raise CliError(f"{path}: no such folder")
    if not path.is_dir():
        raise CliError(f"{path}: expected a checkpoint folder (config.json and *.safetensors), got a file; "
                       f"try its folder {path.parent}")
    try:
        info = inspect_checkpoint(path)
    except (OSError, ValueError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        name, sep, rest = text.partition(": ")  # "model.safetensors: truncated ...": name the file by its path
        if sep and name and (path / name).exists():
            text = f"{path / name}: {rest}"
        elif not text.startswith(str(path)):
            text = f"{path}: {text}"
        raise CliError(text) from exc
    if args.json:
        print(json.dumps(finite_json(info), indent=2, allow_nan=False))
    else:
        print("\n".join(format_inspection(info)))
    return 1 if info.get("problems") else 0


# --------------------------------------------------------------------------------------------- bench


def benchmark_script() -> Path:
    """benchmarks/bench_gemm.py of the source checkout this package runs from (a wheel does not ship it)."""
    root = Path(__file__).resolve().parent.parent
    script = root / BENCHMARK
    if not script.is_file():
        raise CliError(f"bench runs {BENCHMARK.as_posix()} from a source checkout of cupy_moe, and this "
                       f"installation ({root}) has none: clone the repository, install it with pip install -e, "
                       "and run the command from there")
    return script


def run_script(script: Path, argv: list[str], prog: str) -> int:
    """Run `script`'s main(argv, prog) (prog: how its usage and errors name it) with sys.argv = [script, *argv];
    its exit status."""
    saved = sys.argv
    sys.argv = [str(script), *argv]
    try:
        return runpy.run_path(str(script), run_name=script.stem)["main"](argv, prog) or 0
    except SystemExit as exc:  # sys.exit(n), or sys.exit("message"): Python prints the message, status 1
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved


def bench(args) -> int:
    from . import _xp
    script = benchmark_script()
    if _xp.cupy is None:
        raise CliError(gpu_problem())
    # The benchmark parses its arguments first (an error is one line, status 2; --help lists its options with no
    # GPU needed), then measures on the GPU: a failure on a machine without one is that.
    problem = gpu_problem()
    try:
        return run_script(script, args.rest, args.prog)
    except Exception as exc:
        if problem:
            raise CliError(problem) from exc
        raise


# --------------------------------------------------------------------------------------------- tune


def check_cache_folder():
    """A CliError unless the folder of tuned tables (configs.user_dir()) is, or can be made, a writable folder."""
    from .configs import user_dir
    path = user_dir()
    where = (f"the tuned-table folder {path} (from CUPY_MOE_CACHE_DIR)" if os.environ.get("CUPY_MOE_CACHE_DIR")
             else f"the tuned-table folder {path} (CUPY_MOE_CACHE_DIR chooses another)")
    if path.exists() and not path.is_dir():
        raise CliError(f"{where}: expected a writable folder, got a file (--dry-run saves nothing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"{where}: expected a writable folder, and it cannot be created "
                       f"({exc.strerror or type(exc).__name__}; --dry-run saves nothing)") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise CliError(f"{where}: expected a writable folder, got one without write permission "
                       "(--dry-run saves nothing)")


def tune(args) -> int:
    from .tune import tune as run_tune
    models = args.models or list(BENCHMARK_MODELS)
    if not args.dry_run:
        check_cache_folder()
    require_gpu()
    with progress_bar(total=len(models) * 2 * len(args.m), unit="problem", desc="tuning", leave=False) as bar:
        def log(line):  # one line per (model, phase, M) measured, then the line that says where it saved
            bar.write(line, file=sys.stdout)
            if bar.n < bar.total:
                bar.update(1)
        run_tune(models, args.m, reps=args.reps, save=not args.dry_run, log=log)
    return 0


# --------------------------------------------------------------------------------------------- main


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an error instead of one line (also: {DEBUG_ENV} set to "
                             "anything but 0, false, no, off or empty)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = ", ".join(MODELS)
    p = sub.add_parser("demo", help="write a synthetic GPTQ MoE checkpoint, run one layer, check it, time it")
    p.add_argument("--model", type=model_name, default=None,
                   help=f"layer shapes, any case: {names} (default Mixtral-8x7B on a GPU, tiny on the CPU); on "
                        "the CPU a full-size model takes minutes and several GB of disk and memory (the demo prints "
                        "its estimate first)")
    p.add_argument("--tokens", type=token_count, default=8,
                   help=f"tokens M in the batch, 1 to {MAX_TOKENS:,} (2**20) (default 8)")
    p.add_argument("--check-tokens", type=token_count, default=2,
                   help="tokens checked against the float64 reference (default 2)")
    p.add_argument("--reps", type=positive_int, default=50, help="timed graph replays on the GPU (default 50)")
    p.add_argument("--dir", type=non_empty_path,
                   help="keep the checkpoint in this folder, which must be new or empty, instead of a temporary one")
    p.add_argument("--cpu", action="store_true",
                   help="run the NumPy path even when a GPU is present (full-size models: minutes, several GB)")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="random seed of the weights and inputs, a whole number >= 0 (default 0)")
    p.set_defaults(func=demo)
    p = sub.add_parser("inspect", help="describe a checkpoint folder from its configs and headers (no tensor data); "
                                       "exit status 1 when it found problems")
    p.add_argument("path", type=non_empty_path, metavar="PATH",
                   help="the checkpoint folder (config.json, quantization config, *.safetensors)")
    p.add_argument("--json", action="store_true", help="print the full description as JSON")
    p.set_defaults(func=inspect)
    # bench takes no options of its own: everything after it goes to the benchmark (see main)
    sub.add_parser("bench", add_help=False,
                   help=f"run {BENCHMARK.as_posix()} from the checkout; every argument after `bench` (an optional "
                        "`--` first) goes to it: `bench --help` lists them")
    p = sub.add_parser("tune", help="time GEMM configurations on this GPU and keep the fastest per problem in its "
                                    "tuned table")
    p.add_argument("--models", type=model_list, default=None,
                   help="comma-separated model names, any case, each tuned once (default all: "
                        f"{', '.join(BENCHMARK_MODELS)})")
    p.add_argument("--m", type=token_counts, default=(1, 4, 16, 64, 256, 1024, 4096),
                   help=f"comma-separated token counts M, each 1 to {MAX_TOKENS:,} (2**20) and tuned once "
                        "(default 1,4,16,64,256,1024,4096)")
    p.add_argument("--reps", type=positive_int, default=10, help="graph replays per candidate (default 10)")
    p.add_argument("--dry-run", action="store_true",
                   help="measure and print, but do not write the table (without it the table's folder, "
                        "CUPY_MOE_CACHE_DIR or ~/.cache/cupy_moe, is checked before anything is measured)")
    p.set_defaults(func=tune)
    return parser


def parse(argv: list[str], prog: str = PROG) -> argparse.Namespace:
    """Parse argv; for `bench`, every token after the command is kept verbatim in `rest` for the benchmark, which
    names itself `prog`."""
    parser = build_parser(prog)
    command_at = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if command_at is not None and argv[command_at] == "bench":
        args = parser.parse_args(argv[:command_at + 1])
        rest = argv[command_at + 1:]
        args.rest = rest[1:] if rest[:1] == ["--"] else rest
        args.func, args.prog = bench, f"{prog} bench"
        return args
    args, extra = parser.parse_known_args(argv)
    if extra:  # as parse_args, saying where --debug goes when it came after the command
        where = f"; --debug goes before the command: {prog} --debug {args.command} ..." if "--debug" in extra else ""
        parser.error(f"unrecognized arguments: {' '.join(extra)}{where}")
    return args


def error_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    if isinstance(exc, (CliError, OSError, ValueError, TypeError, RuntimeError)):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text} (--debug shows where)"


def program_name(argv_given: bool) -> str:
    """How usage lines and errors name the command: the basename of sys.argv[0] when it runs as a console script
    (`cupy-moe`), else `python -m cupy_moe` (and always when main is given its argv)."""
    base = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return PROG if argv_given or base in ("", "-c", "__main__.py") else base


def debug_on(args) -> bool:
    return args.debug or os.environ.get(DEBUG_ENV, "").strip().lower() not in DEBUG_OFF


@contextmanager
def signals_interrupt():
    """SIGTERM and SIGHUP (where the platform has it) raise KeyboardInterrupt, as SIGINT does, so the `with` blocks
    on the way out remove temporary files; the previous handlers come back on exit. Yields a list that receives
    the number of each signal caught."""
    caught = []

    def handler(signum, frame):
        caught.append(signum)
        raise KeyboardInterrupt

    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal.signal works only there
        for name in ("SIGTERM", "SIGHUP"):
            if hasattr(signal, name):
                previous[name] = signal.signal(getattr(signal, name), handler)
    try:
        yield caught
    finally:
        for name, old in previous.items():
            signal.signal(getattr(signal, name), old)


def silence_stdout():
    """Point stdout's file descriptor at os.devnull, so the flush at exit meets no closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout has no descriptor (captured): nothing is flushed there
        pass


def main(argv=None) -> int:
    prog = program_name(argv is not None)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv, prog)
    debug = debug_on(args)
    with signals_interrupt() as caught:
        try:
            status = args.func(args)
            sys.stdout.flush()  # a closed pipe shows here rather than in the flush at exit
            return status
        except BrokenPipeError:  # stdout's reader left (`| head`): stop quietly, as a shell's tools do
            silence_stdout()
            return SIGPIPE_STATUS
        except KeyboardInterrupt:
            if debug:
                raise
            signum = caught[-1] if caught else signal.SIGINT
            print(f"{prog} {args.command}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
            return 128 + signum
        except Exception as exc:
            if debug:
                raise
            print(f"{prog} {args.command}: error: {error_line(exc)}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
