"""The numba-sc command (also python -m numba_sc): demo, check, ladder, train, figures, book.

demo    runs every stage on a scan and times the kernels beside the NumPy references;
check   compares each stage's kernel with its reference and locates the first mismatch;
ladder  runs each stage's kernels rung by rung (numba_sc.tools.ladder);
train   trains MinkUNet42 (numba_sc.train): "train overfit" fits one labelled scan (a check
        of the backward pass), "train fit" trains over a dataset's scans for some epochs;
figures checks every figure the prose quotes against its result file (numba_sc.tools.prose);
book    builds the site with Sphinx: every notebook executed, docs/, the API reference (numba_sc.tools.book).

Without a GPU the kernels run under Numba's CUDA simulator, on a crop of the cloud.

What a command says while it works goes to stderr: progress bars with an ETA (on a
terminal; numba_sc.core.progress) and log lines, fewer with -q, more with -v. Its output
(tables, files) is what stdout holds.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import warnings
import sys
from pathlib import Path


class UserMistake(Exception):
    """A wrong argument or input file, told on one line of stderr with exit code 2.

    The command line raises it from :func:`_checking`, around the code that reads and
    checks what the user gave, before any work starts; an exception raised later (in
    the work itself) is a bug of ours and keeps its traceback. One kind of mistake
    can only show up during the work: a damaged file deep in a dataset
    (:class:`numba_sc.train.labels.DataError`), which :func:`main` reports the same way.
    """


@contextlib.contextmanager
def _checking():
    """Turn what the argument and input checks raise into a :class:`UserMistake`."""
    try:
        yield
    except (ValueError, TypeError, OSError) as e:
        raise UserMistake(str(e) or type(e).__name__) from e


def _output_file(path, option):
    """Refuse, before any work, an output path that cannot be written
    (:func:`numba_sc.core.files.check_writable`), or an existing file there that may
    not be replaced. Returns the path (a Path)."""
    from .core.files import check_writable

    with _checking():
        path = check_writable(path, option)
    if path.exists() and not os.access(path, os.W_OK):
        raise UserMistake(f"{option} {path}: cannot write there (no permission); give a path you can write")
    return path


def _ensure_kernels_can_run():
    """Without a GPU, restart this command under Numba's CUDA simulator.

    The simulator can only be chosen before numba is imported, and importing
    ``numba_sc`` imports numba, so the command re-executes itself once with
    ``NUMBA_ENABLE_CUDASIM=1`` in the environment.
    """
    from .core.device import gpu_present, simulating

    if simulating() or gpu_present() or os.environ.get("NUMBA_ENABLE_CUDASIM") == "0":
        return
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "numba_sc", *sys.argv[1:]], env)


EXAMPLES = """examples:
  numba-sc demo                                  every stage on a synthetic LiDAR scene
  numba-sc demo --points scan.bin --columns 4    ... on a KITTI-style float32 .bin file
  numba-sc check --stage gather                  one stage's kernel against its reference
  numba-sc ladder --list                         every ladder's rungs, and what each adds
  numba-sc ladder gather scatter --dtypes float16
  numba-sc ladder gather --rung v2               one rung: code, diff, check, time, napkin math
  numba-sc train overfit --steps 300 --out curve.json   fit MinkUNet42 to the labelled scan
  numba-sc train fit --data KITTI --split train --epochs 10 --eval valid --save run.npz --log run.json
  numba-sc -q train fit --data KITTI --epochs 1   ... only warnings, errors and the IoU tables
  numba-sc book                                  the site (notebooks run, docs, API) in build/book
"""


def _at_least(low, kind=int):
    """An argparse type: a ``kind`` number >= ``low``, with a message that says so."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if not v >= low or (kind is float and v != v):
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return v
    parse.__name__ = f"{kind.__name__} >= {low}"
    return parse


def _positive_float(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def _dtypes(text):
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names or any(n not in ("float32", "float16") for n in names):
        raise argparse.ArgumentTypeError(f"a comma-separated list of float32 and float16, got {text!r}")
    return names


def _version():
    from . import __version__

    return __version__


def _talk_options(parser, top=False):
    """-q/-v and --progress/--no-progress: on the numba-sc command (``top``, with the
    defaults) and again on each subcommand (without defaults, so that one given before
    the subcommand is not undone), so they may stand before or after it."""
    keep = {} if top else {"default": argparse.SUPPRESS}
    talk = parser.add_mutually_exclusive_group()
    talk.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1,
                      **(keep or {"default": 0}), help="only warnings and errors on stderr, and no progress bars")
    talk.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1,
                      **(keep or {"default": 0}), help="debug lines too (e.g. every logged training step)")
    bars = parser.add_mutually_exclusive_group()
    bars.add_argument("--progress", dest="progress", action="store_const", const=True, **(keep or {"default": None}),
                      help="draw progress bars on stderr even when it is not a terminal")
    bars.add_argument("--no-progress", dest="progress", action="store_const", const=False, **keep,
                      help="no progress bars (default: bars when stderr is a terminal; $NUMBA_SC_PROGRESS=1/0)")


log = logging.getLogger("numba_sc.cli")  # (the command's own lines; __name__ is "__main__" when run with -m)

_CLI_HANDLER = "numba-sc command line"  # the name of the handler main() adds (and takes away)


def _configure_logging(verbosity):
    """Show the library's loggers (``numba_sc.*``) on stderr at INFO, WARNING with -q,
    DEBUG with -v, through a handler that keeps progress bars whole. Only the command
    does this: library code never configures logging. Returns a function that undoes it."""
    from .core.progress import BarSafeHandler

    logger = logging.getLogger("numba_sc")
    for h in [h for h in logger.handlers if h.get_name() == _CLI_HANDLER]:
        logger.removeHandler(h)
    handler = BarSafeHandler()
    handler.set_name(_CLI_HANDLER)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s" if verbosity > 0 else
                                           "%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel({-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}[verbosity])

    def undo():
        logger.removeHandler(handler)
        logger.setLevel(level)
    return undo


_TOP_FLAGS = {"-q", "--quiet", "-v", "--verbose", "--progress", "--no-progress"}
# The old spelling of train: options of one job that the other job ignored, dropped
# (with a word) when the old spelling is rewritten; True: the option takes a value.
_ONLY_OVERFIT = {"--steps": True, "--crop": True, "--out": True}
_ONLY_FIT_IGNORED = {"--batch-size": True, "--workers": True, "--no-augment": False, "--amp": False}
_ONLY_FIT_REFUSED = ("--save", "--log", "--resume", "--eval", "--sequences", "--split", "--gpus")


def _new_train_spelling(argv):
    """``argv`` with ``train``'s old spelling rewritten into the new one, and a message
    saying so (None when ``argv`` is not the old spelling).

    Old: ``train --steps N [--data FOLDER]`` fitted one scan; ``train --data ROOT
    --epochs E`` trained over a dataset, so --data named a folder of one scan in the
    first and a dataset in the second. New: ``train overfit --scan FILE`` and ``train
    fit --data ROOT``. The old spelling keeps working for one release: ``--epochs``
    makes it ``fit``, its absence ``overfit`` (whose hidden --data keeps the old
    meaning). Options the old spelling ignored in a mode are left out (and said);
    the ones it refused there are refused as before."""
    i = 0
    while i < len(argv) and argv[i] in _TOP_FLAGS:
        i += 1
    if i >= len(argv) or argv[i] != "train":
        return argv, None
    rest = argv[i + 1:]
    if rest and rest[0] in ("fit", "overfit", "-h", "--help"):
        return argv, None
    names = [a.split("=", 1)[0] for a in rest if a.startswith("--")]
    if "--epochs" in names:
        job, drop = "fit", _ONLY_OVERFIT
    else:
        refused = [o for o in _ONLY_FIT_REFUSED if o in names]
        if refused:  # (they would be ignored: one scan's fit writes only --out)
            raise UserMistake(f"{', '.join(refused)}: only for training on a dataset: add --epochs E (and --data "
                              "ROOT), or leave them out (new spelling: numba-sc train fit --data ROOT --epochs E)")
        job, drop = "overfit", _ONLY_FIT_IGNORED
    kept, dropped, k = [], [], 0
    while k < len(rest):
        name = rest[k].split("=", 1)[0]
        if name in drop:
            takes_value = drop[name] and "=" not in rest[k]
            dropped.append(" ".join(rest[k:k + 1 + takes_value]))
            k += 1 + takes_value
            continue
        kept.append(rest[k])
        k += 1
    shown = list(kept)
    if job == "overfit" and "--data" in shown[:-1]:  # the new spelling names the scan itself
        j = shown.index("--data")
        shown[j:j + 2] = ["--scan", str(Path(shown[j + 1]) / "semantickitti_000000.bin")]
    old = " ".join(["numba-sc train", *map(shlex.quote, rest)])
    new = " ".join(["numba-sc train", job, *map(shlex.quote, shown)])
    message = (f"'{old}' is the old spelling of '{new}' (deprecated: it works in this release and goes in the next; "
               "use the new one)" + (f"; left out, as the old spelling ignored them: {', '.join(dropped)}"
                                     if dropped else ""))
    return argv[:i + 1] + [job] + kept, message


def _say_deprecated(message, from_shell):
    """The old spelling's message: one line on stderr from the shell (where a Python
    warning would print a file and a line number), a FutureWarning to a program that
    calls :func:`main` (which it can filter or turn into an error)."""
    if from_shell:
        log.warning("numba-sc: %s", message)
    else:
        warnings.warn(message, FutureWarning, stacklevel=3)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="numba-sc", description=__doc__, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"numba-sc {_version()}")
    _talk_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,check,ladder,train,figures,book}")
    cols, crop = _at_least(3), _at_least(1)

    def command(name, help_, example):
        p = sub.add_parser(name, help=help_, description=help_, epilog=f"example:\n  {example}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name != "train":  # (train's options are on its two jobs)
            _talk_options(p)
        return p

    d = command("demo", "run every stage on a scan, kernels against references",
                "numba-sc demo --points scan.bin --columns 4 --crop 1000")
    d.add_argument("--points", help="KITTI-style float32 .bin file (default: a synthetic LiDAR scene)")
    d.add_argument("--columns", type=cols, default=4, help="float32 columns per point in --points (default 4)")
    d.add_argument("--voxel-size", type=_positive_float, default=0.05, help="voxel edge in metres (default 0.05)")
    d.add_argument("--crop", type=crop, default=1500, help="points the simulated kernels run on (default 1500)")
    c = command("check", "compare every stage's kernel with its reference, locate mismatches",
                "numba-sc check --stage 'kernel map' --crop 800")
    c.add_argument("--points", help="KITTI-style float32 .bin file (default: a synthetic LiDAR scene)")
    c.add_argument("--columns", type=cols, default=4, help="float32 columns per point in --points (default 4)")
    c.add_argument("--voxel-size", type=_positive_float, default=0.05, help="voxel edge in metres (default 0.05)")
    c.add_argument("--stage", help="only the stages whose name contains this text")
    c.add_argument("--crop", type=crop, default=1500, help="points the simulated kernels run on (default 1500)")
    lad = command("ladder", "each stage's kernels rung by rung: agreement (no GPU) or GPU times",
                  "numba-sc ladder gather scatter --channels 16 --dtypes float32")
    lad.add_argument("stages", nargs="*", metavar="STAGE",
                     help="ladders, named after their modules or the operation they climb, e.g. gather "
                          "forward_search batch_norm_backward (default: all; --list names them)")
    lad.add_argument("--list", action="store_true", help="name every ladder, its module, its rungs and what each adds")
    lad.add_argument("--points", help="KITTI-style float32 .bin file (default: the SemanticKITTI scan in "
                                      "$NUMBA_SC_DATA or ../shared/data, else a synthetic LiDAR scene)")
    lad.add_argument("--columns", type=cols, default=4, help="float32 columns per point in --points (default 4)")
    lad.add_argument("--voxel-size", type=_positive_float, default=0.05, help="voxel edge in metres (default 0.05)")
    lad.add_argument("--crop", type=crop, default=300,
                     help="points the simulated kernels run on, without a GPU (default 300)")
    lad.add_argument("--channels", type=_at_least(1), default=None,
                     help="channels (default 64 on a GPU, 8 simulated)")
    lad.add_argument("--dtypes", type=_dtypes, default="float32,float16",
                     help="feature dtypes, comma-separated: float32, float16 (default both)")
    lad.add_argument("--rounds", type=_at_least(1), default=20, help="timed rounds on a GPU (default 20)")
    lad.add_argument("--out", help="write the table as JSON (with device, date and command)")
    lad.add_argument("--note", default="", help="what code this run measured (recorded with --out)")
    lad.add_argument("--plot", metavar="FILE.png",
                     help="bars of the ladder: your GPU times beside the recorded ones (no GPU: the recorded alone)")
    one = lad.add_argument_group("one rung (numba_sc.tools.rung), with one STAGE",
                                 "e.g. numba-sc ladder gather --rung v2 --break 1,3 --crop 200")
    one.add_argument("--rung", metavar="vN", help="print the rung's kernel and its diff from the rung below, "
                                                  "check it, time it beside the recorded figure, do its napkin math")
    one.add_argument("--break", dest="break_at", metavar="B,T",
                     help="stop in pdb inside the rung's kernel at block B, thread T (1-D indices; under the "
                          "simulator only)")
    one.add_argument("--kernel", metavar="NAME",
                     help="with --break: the kernel of the stage's module to stop in (default: the rung's own; "
                          "for a rung that is a host function, the first kernel it launches)")
    tr = command("train", "train MinkUNet42 on labelled scans: overfit one scan, or fit a dataset",
                 "numba-sc train fit --data KITTI --split train --epochs 10 --eval valid")
    _talk_options(tr)
    jobs = tr.add_subparsers(dest="job", required=True, metavar="{overfit,fit}")

    def job(name, help_, example):
        p = jobs.add_parser(name, help=help_, description=help_, epilog=f"example:\n  {example}",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        _talk_options(p)
        return p

    ov = job("overfit", "fit MinkUNet42 to one labelled scan: a check of the backward pass, not a training recipe",
             "numba-sc train overfit --steps 100 --crop 2000 --out curve.json")
    ov.add_argument("--scan", metavar="FILE.bin",
                    help="a KITTI-style scan (float32 x, y, z, remission) with its SemanticKITTI labels beside it "
                         "(FILE.label) (default: semantickitti_000000.bin in $NUMBA_SC_DATA or ../shared/data)")
    ov.add_argument("--labels", metavar="FILE.label", help="the scan's labels, when not beside it as FILE.label")
    ov.add_argument("--data", help=argparse.SUPPRESS)  # the old spelling's folder of the scan (deprecated)
    ov.add_argument("--steps", type=_at_least(1), default=300, help="training steps (default 300)")
    ov.add_argument("--crop", type=crop, default=None,
                    help="train on this many points around one point (default: the whole scan on a GPU, "
                         "600 points without one)")
    ov.add_argument("--log-every", type=_at_least(1), default=10,
                    help="score and log every this many steps (default 10)")
    ov.add_argument("--out", help="write the loss and score curve as JSON (with device, date and command)")
    ft = job("fit", "train MinkUNet42 over the scans of a dataset for some epochs, scoring held-out scans",
             "numba-sc train fit --data KITTI --split train --epochs 10 --batch-size 4 --eval valid --save run.npz")
    ft.add_argument("--data", metavar="ROOT",
                    help="the dataset: a SemanticKITTI folder (ROOT/sequences/NN/velodyne, labels) or a folder of "
                         "name.bin / name.label pairs")
    ft.add_argument("--epochs", type=_at_least(1), required=True, help="passes over the scans of --data")
    ft.add_argument("--sequences", nargs="+", help="SemanticKITTI sequences to train on, e.g. 00 01 (default: all)")
    ft.add_argument("--split", choices=("train", "valid"), help="SemanticKITTI's standard split to train on")
    ft.add_argument("--batch-size", type=_at_least(1), default=2, help="scans per batch (default 2)")
    ft.add_argument("--workers", type=_at_least(0), default=2, help="threads preparing batches (default 2)")
    ft.add_argument("--no-augment", action="store_true", help="no rotation, flips, scaling or jitter")
    ft.add_argument("--save", help="checkpoint written after every epoch (.npz)")
    ft.add_argument("--resume", help="checkpoint of a stopped run to continue (the same settings, --epochs included)")
    ft.add_argument("--eval", dest="eval_data",
                    help="held-out scans scored after every epoch (a per-class IoU table on stdout): a folder, or "
                         "'valid' (sequence 08 of --data)")
    ft.add_argument("--log", help="the run's history as JSON, and a plot of it beside (.png)")
    ft.add_argument("--log-every", type=_at_least(1), default=10,
                    help="a debug line (-v) every this many batches (default 10)")
    ft.add_argument("--amp", action="store_true",
                    help="mixed precision: float16 compute, float32 master weights, dynamic loss scaling")
    ft.add_argument("--gpus", type=_at_least(1), default=None,
                    help="data-parallel over this many GPUs of this machine, one process each (--batch-size is "
                         "the global batch); several machines: see numba_sc.train.parallel")
    for p in (ov, ft):
        p.add_argument("--lr", type=_positive_float, default=2e-3, help="AdamW's peak learning rate (cosine schedule)")
        p.add_argument("--width", type=_positive_float, default=1.0, help="MinkUNet42 channel multiplier (default 1.0)")
        p.add_argument("--seed", type=_at_least(0), default=0)
    fg = command("figures", "check every performance figure quoted in the prose against benchmarks/results/",
                 "numba-sc figures --update")
    fg.add_argument("--update", action="store_true",
                    help="rewrite stale figure links from their result files (after a benchmark ran again)")
    bk = command("book", "build the site with Sphinx: every notebook executed, in the paper's order, docs/ and "
                         "the API reference, with search", "numba-sc book --out build/book --jobs 2 --only 05 06")
    bk.add_argument("--out", default="build/book", help="the site's folder (default build/book)")
    bk.add_argument("--jobs", type=_at_least(1), default=None,
                    help="notebooks executed at once, each in its own kernel (default: one per core)")
    bk.add_argument("--only", nargs="+", metavar="NAME",
                    help="execute only these notebooks (file name or number); the others keep the outputs of "
                         "an earlier build in --out")
    bk.add_argument("--no-execute", action="store_true",
                    help="render the notebooks as committed, without running them (no outputs)")
    given = sys.argv[1:] if argv is None else list(argv)
    try:
        given, deprecated = _new_train_spelling(given)
    except UserMistake as e:
        print(f"numba-sc train: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(given)

    if argv is None:
        _ensure_kernels_can_run()
    from .core.progress import set_progress
    from .train.labels import DataError

    undo = _configure_logging(args.verbosity)
    set_progress(args.progress if args.progress is not None else (False if args.verbosity < 0 else None))
    try:
        if deprecated:
            _say_deprecated(deprecated, argv is None)
        return _run(args, given)
    except (UserMistake, DataError) as e:
        print(f"numba-sc {args.command}: {e}", file=sys.stderr)
        return 2
    finally:
        undo()
        set_progress(None)


def _run(args, argv):
    """The command ``args`` asks for; its exit status."""
    if args.command == "demo":
        from .tools.demo import demo, load_points

        with _checking():
            loaded = load_points(args.points, args.columns) if args.points else None
        return demo(args.points, args.columns, args.voxel_size, args.crop, loaded=loaded)
    if args.command == "check":
        from .tools.check import run_check, select_stages
        from .tools.demo import load_points
        from .tools.synthetic import lidar_scene

        with _checking():
            select_stages(args.stage)
            points, feats = load_points(args.points, args.columns) if args.points else (None, None)
        if points is None:
            points, intensity = lidar_scene()
            feats = intensity[:, None]
        results = run_check(points, feats, args.voxel_size, args.stage, args.crop)
        return 0 if all(ok for _, ok, _ in results) else 1
    if args.command == "ladder":
        return _ladder(args)
    if args.command == "figures":
        return _figures(args)
    if args.command == "train":
        for option in ("out", "save", "log"):  # before any work: a run must not be lost to a typo here
            if getattr(args, option, None):
                _output_file(getattr(args, option), f"--{option}")
        return _train_dataset(args, argv) if args.job == "fit" else _train(args)
    if args.command == "book":
        from .tools import book as book_module
        from .tools.book import main as book

        if not any(book_module.NOTEBOOK_DIR.glob("*.ipynb")):
            print(f"numba-sc book: no notebooks in {book_module.NOTEBOOK_DIR}: the book is built from a clone "
                  "of the repository (notebooks/, docs/), not from an installed package; run it in a clone",
                  file=sys.stderr)
            return 2
        import importlib.util

        missing = [m for m in ("sphinx", "myst_nb", "jupyter_cache") if importlib.util.find_spec(m) is None]
        if missing:
            print(f"numba-sc book: {', '.join(missing)} not installed: the site is built with Sphinx and "
                  "myst-nb; pip install -e '.[dev]'", file=sys.stderr)
            return 2

        return book(args.out, args.jobs, args.only, execute=not args.no_execute)
    return 2


def _figures(args):
    """Check (or, with --update, rewrite) the figures the prose quotes (numba_sc.tools.prose)."""
    from .tools import results
    from .tools.prose import check_prose, update_prose

    folder = results.results_folder()
    if not folder.is_dir() or not (results.ROOT / "README.md").is_file():
        # An installed wheel holds the engine, not the repository's prose and results:
        # checking nothing must not read as "every figure is right".
        print(f"numba-sc figures: no numba-sc checkout here (no {folder} or "
              f"{results.ROOT / 'README.md'}): it checks a clone's prose against its benchmarks/results/; "
              "run it in a clone of the repository", file=sys.stderr)
        return 2
    if args.update:
        for change in update_prose():
            print(f"updated {change}")
    findings = check_prose()
    for f in findings:
        print(f)
    print(f"{len(findings)} problems with the quoted figures" if findings else "every quoted figure is the recorded one")
    return 1 if findings else 0


def _data_folder(filenames, explicit=None):
    """The folder (a Path) that holds every file of ``filenames``: ``explicit`` when
    given, which must hold them (an explicit folder is used or refused, never replaced
    by another); else the first of $NUMBA_SC_DATA, ../shared/data and
    ../../shared/data that holds them, or None."""
    if explicit:
        folder = Path(explicit)
        if not folder.is_dir():
            raise UserMistake(f"--data {explicit}: no such folder")
        missing = [f for f in filenames if not (folder / f).is_file()]
        if missing:
            raise UserMistake(f"--data {explicit} has no {' or '.join(missing)}; give the folder that holds "
                              f"{' and '.join(filenames)}")
        return folder
    for d in (os.environ.get("NUMBA_SC_DATA"), "../shared/data", "../../shared/data"):
        if d and all((Path(d) / f).is_file() for f in filenames):
            return Path(d)
    return None


def _train_dataset(args, argv):
    """``train fit --data ROOT --epochs E``: a run over a dataset (numba_sc.train.run); with ``--gpus N``
    (and no WORLD_SIZE in the environment) the launcher of N such runs, one per GPU,
    which find their rank in the environment (numba_sc.train.parallel)."""
    from .core.device import gpu_present, simulating
    from .nn import models
    from .train import data, labels, optim, parallel
    from .train import run as tr
    from .train.trainer import Trainer

    if not args.data:
        raise UserMistake("--data ROOT is needed: a SemanticKITTI dataset folder or a folder of .bin/.label pairs "
                          "(to fit one scan: numba-sc train overfit --scan FILE)")
    with _checking():
        scans = data.ScanFolder(args.data, sequences=args.sequences, split=args.split)
        held = None
        if args.eval_data == "valid":
            held = data.ScanFolder(args.data, split="valid")
        elif args.eval_data:  # (scored after every epoch: its labels must be there before the first)
            try:
                held = data.ScanFolder(args.eval_data, require_labels=True)
            except FileNotFoundError as e:
                raise UserMistake(f"--eval {args.eval_data}: {e}. The held-out scans are scored, so each needs "
                                  "its .label; give a labelled folder, or 'valid'") from e
        placement = parallel.placement_from_environment()
        checkpoint = tr.read_checkpoint(args.resume) if args.resume else None
    on_gpu = gpu_present() and not simulating()
    if args.gpus and args.gpus > 1 and placement is None:  # the launcher: N copies of this command
        count = 0
        if on_gpu:
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
        if args.gpus > count:
            print(f"train --gpus {args.gpus}: this machine has {count} CUDA GPU(s); --gpus starts one process per "
                  "GPU", file=sys.stderr)
            return 2
        if args.batch_size < args.gpus:
            print(f"train --gpus {args.gpus}: --batch-size {args.batch_size} is the global batch, cut into one "
                  f"share per GPU; give at least {args.gpus}", file=sys.stderr)
            return 2
        return parallel.spawn(args.gpus, [sys.executable, "-m", "numba_sc", *argv])
    if placement is not None and placement.size > 1 and not on_gpu:
        print(f"train: WORLD_SIZE={placement.size} asks for a data-parallel run, which needs a CUDA GPU per "
              "process (NCCL); this one sees none", file=sys.stderr)
        return 2
    backend = "cuda" if on_gpu else "reference"  # (without a GPU: the NumPy references, as train does)
    augmentation = not args.no_augment
    comm = parallel.connect(placement)  # (one process: parallel.Solo; else this rank's GPU and NCCL)
    main_rank = comm.rank == 0

    def prepare(points, raw, rng):
        return tr.prepare_scan(points, raw, rng, 0.05, augmentation, on_gpu)

    with _checking():
        loader = parallel.ShardedLoader(scans, args.batch_size, prepare, rank=comm.rank, size=comm.size,
                                        seed=args.seed, workers=args.workers)
    # The data folder by its resolved path: "x", "./x" and "x/" are one folder to --resume.
    settings = {"data": str(Path(args.data).resolve()), "sequences": args.sequences, "split": args.split,
                "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "width": args.width,
                "seed": args.seed, "augmentation": augmentation, "amp": args.amp}
    if checkpoint is not None:  # the settings first: a checkpoint of another --width fails on shapes later
        _same_settings(checkpoint, settings, args.resume)
    model = models.MinkUNet42(len(tr.FEATURES), labels.NUM_CLASSES, width=args.width, seed=args.seed)
    if on_gpu:
        model.cuda()
    opt = optim.AdamW(model.trainable_parameters(), lr=args.lr, weight_decay=1e-2)
    trainer = Trainer(model, opt, comm=comm, amp=args.amp, backend=backend)
    total = args.epochs * len(loader)
    start, history = 0, []
    if checkpoint is not None:
        start, history, _ = tr.resume(checkpoint, model, opt, trainer)
        if main_rank:
            log.info("resumed from %s: %d epoch(s) done", args.resume, start)
    if main_rank:
        log.info("data: %s", scans.root.resolve())
        log.info(f"MinkUNet42 (width {args.width}) on {len(scans)} scans ({scans.layout}), batches of {args.batch_size}"
              f"{f' over {comm.size} GPUs' if comm.size > 1 else ''}, epochs {start + 1}..{args.epochs}, "
              f"backend {backend}{', mixed precision' if args.amp else ''}")
    history = tr.fit_dataset(model, opt, loader, args.epochs,
                             schedule=lambda s: optim.cosine_lr(s, total, args.lr, warmup=min(10, total)),
                             start_epoch=start, history=history, save_to=args.save, eval_scans=held,
                             settings=settings, backend=backend, log_every=args.log_every, trainer=trainer)
    if args.log and main_rank:
        tr.write_log(history, args.log)
    if hasattr(comm, "close"):
        comm.close()
    return 0


def _same_settings(checkpoint, settings, path):
    """Refuse to resume ``checkpoint`` (read from ``path``) with other ``settings``.

    The number of epochs is one of them: the learning rate follows a cosine over the
    whole run, so a run resumed with another --epochs would continue on another
    curve than the one it started (its next rate would jump), and would no longer be
    the run it resumes. To train longer, start a new run with the larger --epochs."""
    saved = {"amp": False, **checkpoint.get("settings", {})}  # (checkpoints from before --amp were not amp)
    if saved.get("data") is not None:  # (checkpoints from before paths were resolved hold them as given)
        saved["data"] = str(Path(saved["data"]).resolve())
    differ = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v}
    if differ:
        hint = (f"; its learning rate follows a cosine over {saved['epochs']} epochs: resume with --epochs "
                f"{saved['epochs']}, or start a new run to train for {settings['epochs']}" if "epochs" in differ else "")
        raise UserMistake(f"--resume {path} was written with other settings {differ} (saved, given); resume "
                          f"with the same ones{hint}")


def _overfit_scan(args):
    """``train overfit``'s scan and labels (two Paths): ``--scan`` (its labels beside it, or
    ``--labels``), the old spelling's ``--data FOLDER``, or the shared SemanticKITTI scan."""
    scan_files = ("semantickitti_000000.bin", "semantickitti_000000.label")
    if args.scan and args.data:
        raise UserMistake("--data FOLDER is the old spelling of --scan FOLDER/semantickitti_000000.bin: give --scan")
    if args.scan:
        scan = Path(args.scan)
        if not scan.is_file():
            raise UserMistake(f"--scan {args.scan}: no such file" + (" (it is a folder: give the .bin in it)"
                                                                     if scan.is_dir() else ""))
    else:
        folder = _data_folder(scan_files, args.data)
        if folder is None:
            raise UserMistake(f"{' and '.join(scan_files)} not found in $NUMBA_SC_DATA, ../shared/data or "
                              "../../shared/data: give --scan FILE.bin")
        scan = folder / scan_files[0]
    label_file = Path(args.labels) if args.labels else scan.with_suffix(".label")
    if not label_file.is_file():
        raise UserMistake(f"--labels {args.labels}: no such file" if args.labels else
                          f"--scan {scan}: no labels beside it ({label_file.name}); give --labels FILE.label")
    return scan, label_file


def _train(args):
    """``train overfit``: MinkUNet42 fitted to one labelled scan (numba_sc.train.loop.fit_scan)."""
    import json
    import time

    import numpy as np

    from .train import labels
    from .nn import models
    from .train import optim
    from .train import loop as train
    from .core.device import gpu_present, simulating
    from .tools.check import crop_points

    with _checking():
        scan, label_file = _overfit_scan(args)
        if scan.stat().st_size % 16:
            raise ValueError(f"{scan} has {scan.stat().st_size} bytes, not whole points of 16 (x, y, z, remission "
                             "as float32)")
        points = np.fromfile(scan, np.float32).reshape(-1, 4)
        raw = labels.load_semantickitti_labels(label_file)
    log.info("data: %s", scan.resolve())
    if len(raw) != len(points):
        raise UserMistake(f"{label_file} has {len(raw):,} labels but the .bin has {len(points):,} points; they must "
                          "be a scan and its own labels, one label per point")
    on_gpu = gpu_present() and not simulating()
    crop = args.crop if args.crop is not None else (None if on_gpu else 600)
    if crop:
        keep = crop_points(points[:, :3], crop)  # (x, y, z: not the remission column)
        points, raw = points[keep], raw[keep]
    if (labels.learning_map(raw) == labels.IGNORE_INDEX).all():
        raise UserMistake(f"the {len(points):,} point(s) of {'--crop ' + str(crop) if crop else 'the scan'} have no "
                          "scored label (all unlabeled or ignored classes): nothing to learn from; give a larger "
                          "--crop (e.g. 600)")
    backend = "cuda" if on_gpu else "reference"
    x, target, inverse, point_target = train.scan_tensor(points, raw, 0.05, backend)
    model = models.MinkUNet42(4, labels.NUM_CLASSES, width=args.width, seed=args.seed)
    if on_gpu:
        model.cuda()
    opt = optim.AdamW(model.trainable_parameters(), lr=args.lr, weight_decay=0.0)
    log.info(f"MinkUNet42 (width {args.width}) on {len(points):,} points, {len(x):,} voxels, "
          f"{args.steps} steps of AdamW, backend {backend}")
    history = train.fit_scan(model, opt, x, target, inverse, point_target, args.steps, backend,
                             schedule=lambda s: optim.cosine_lr(s, args.steps, args.lr, warmup=min(10, args.steps)),
                             log_every=args.log_every)
    if args.out:
        from .core.device import device_name

        rec = {"points": int(len(points)), "voxels": int(len(x)), "width": args.width, "steps": args.steps,
               "lr": args.lr, "history": history,
               "recorded": {"device": device_name(), "date": time.strftime("%Y-%m-%d"),
                            "command": "python -m numba_sc " + " ".join(sys.argv[1:])}}
        from .core.files import write_text

        write_text(args.out, json.dumps(rec, indent=1), name="--out")
        log.info("wrote %s", args.out)
    return 0


def _ladder(args):
    import numpy as np

    from .core.device import gpu_present, simulating
    from .tools.breakpoints import parse_break
    from .tools.check import crop_points
    from .tools.demo import load_points
    from .tools.ladder import Context, ladders, list_ladders, plot_ladder, recorded_rows, run_ladder
    from .tools.rung import break_target, run_rung, timed_rows
    from .tools.synthetic import lidar_scene
    from .coords.voxelization import voxelize

    if args.list:
        list_ladders()
        return 0
    found = ladders()
    stages = args.stages or list(found)
    unknown = [s for s in stages if s not in found]
    if unknown:
        print(f"no ladder for {unknown}; stages with one: {', '.join(found)}", file=sys.stderr)
        return 2
    on_gpu = gpu_present() and not simulating()
    stop = None
    if args.rung is None and (args.break_at or args.kernel):
        raise UserMistake("--break and --kernel stop in one rung's kernel: give one STAGE and --rung vN")
    if args.rung is not None:
        if len(args.stages) != 1:
            raise UserMistake(f"--rung runs one rung of one ladder: give one STAGE, e.g. numba-sc ladder gather "
                              f"--rung {args.rung} (got {len(args.stages)})")
        declared = [r.name for r in found[stages[0]].declared]
        if args.rung not in declared:
            raise UserMistake(f"--rung: {stages[0]} has the rungs {', '.join(declared)}, got {args.rung!r}")
        if args.out:
            raise UserMistake("--out records a whole ladder run; leave out --rung to record one")
        if args.kernel and not args.break_at:
            raise UserMistake("--kernel names the kernel --break stops in; give --break B,T with it")
        if args.break_at:
            if on_gpu:
                raise UserMistake("--break needs Numba's CUDA simulator: run with NUMBA_ENABLE_CUDASIM=1 (on a GPU "
                                  "a kernel's threads are not Python threads that pdb can stop in)")
            with _checking():
                stop = parse_break(args.break_at)
                break_target(stages[0], args.rung, args.kernel)  # a --kernel that names no kernel: refused now
    if args.plot:
        _output_file(args.plot, "--plot")
        if not on_gpu and not any(recorded_rows(s)[2] for s in stages):
            raise UserMistake(f"--plot: no GPU here and no recorded ladder of {', '.join(stages)}: nothing to plot")
    source = args.points
    if source is None:
        folder = _data_folder(("semantickitti_000000.bin",))
        source = str(folder / "semantickitti_000000.bin") if folder else None
    if args.out:
        _output_file(args.out, "--out")
    if source:
        with _checking():
            points, _ = load_points(source, args.columns)
    else:
        points, _ = lidar_scene()
    if not on_gpu:
        points = points[crop_points(points, args.crop)]
    coords = voxelize(np.ascontiguousarray(points[:, :3]), args.voxel_size, backend="reference").coords
    print(f"{source or 'synthetic LiDAR scene'}: {len(coords)} voxels at {args.voxel_size} m"
          + ("" if on_gpu else f" (a crop of {len(points)} points: kernels under the simulator, no times)"))
    channels = args.channels or (64 if on_gpu else 8)
    if args.rung is not None:
        context = Context(coords, channels, points=points, voxel_size=args.voxel_size)
        rows = run_rung(stages[0], args.rung, context, args.dtypes, args.rounds, stop=stop, kernel=args.kernel)
        if args.plot:
            plot_ladder(stages, timed_rows(rows), args.plot)
        failed = [r["dtype"] for r in rows if r["agrees"] is False]
        if failed:
            print(f"{stages[0]} {args.rung} disagrees with the reference in {', '.join(failed)}")
        missed = stop is not None and rows and "stopped" in rows[0] and not rows[0]["stopped"].hit
        return 1 if failed or missed or any(r.get("quit") for r in rows) else 0
    rows = run_ladder(stages, coords, channels, args.dtypes, args.rounds, args.out, args.note,
                      points=points, voxel_size=args.voxel_size)
    if args.plot:
        plot_ladder(stages, rows, args.plot)
    bad = [r for r in rows if not r["agrees"]]
    if bad:
        print(f"{len(bad)} rung(s) disagree with the reference: {[(r['stage'], r['dtype'], r['rung']) for r in bad]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
