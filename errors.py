"""The one error a user sees: bad input, reported as a single line `error: ...` and exit status 1.

Library code raises a subclass of `UserError`; each command line's `__main__` hands its `main` to
`run_cli`, the only place that turns the error into that line. Anything else is a bug and keeps
its traceback. Ctrl-C prints `interrupted` and exits 130, also while a script still imports torch
(`quiet_ctrl_c`, before run_cli).
"""
import os
import signal
import sys
import threading
from pathlib import Path

import liveness


class UserError(Exception):
    """Bad input from the user (a flag, a file, a checkpoint); the message is meant for them."""


class ConfigError(UserError):
    """A config.json this engine cannot run."""


class CheckpointError(UserError):
    """A checkpoint directory that is missing, incomplete or unreadable."""


class TokenizerError(UserError):
    """Tokenizer files that are missing or cannot be used."""


class QuantizeError(UserError):
    """A quantization scheme or request that cannot be carried out."""


class ConvertError(UserError):
    """A source model that cannot be converted."""


class TPError(UserError):
    """A tensor-parallel setup that cannot run (world size, sharding, a failed rank)."""


def require_dir(checkpoint_dir) -> Path:
    """The checkpoint directory as a Path, or a CheckpointError if it is none (here, without torch,
    for a command line to check its flags with)."""
    ckpt = Path(checkpoint_dir)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist (get one with `python download.py`)")
    return ckpt


def log(*args):
    """A line for the user on stderr (stdout carries the generated text)."""
    print(*args, file=sys.stderr, flush=True)


def one_line(e: BaseException) -> str:
    """An exception's message on one line (its type when the message is empty)."""
    return " ".join(str(e).split()) or type(e).__name__


def interrupted_quietly(signum, frame):
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)  # nothing is written before main(); an import's `except:` cannot swallow this


def quiet_ctrl_c():
    """Until run_cli starts: Ctrl-C exits 130 without the traceback of whatever was importing
    (torch takes seconds)."""
    signal.signal(signal.SIGINT, interrupted_quietly)


def run_cli(main, argv=None):
    """Run a command line's main(): a UserError becomes `error: ...` on stderr and exit 1."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is interrupted_quietly:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt again: cleanups run on the way out
    code = 0
    try:
        main(argv)
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:  # what was being written has been cleaned up on the way out
        print("interrupted", file=sys.stderr)
        code = 130
    if any(t.name == "compile" and t.is_alive() for t in threading.enumerate()):
        # a thread still in the compiler (warmup.compile_aside) makes the interpreter's shutdown abort
        liveness.stop()  # as tp.close would at exit: the other ranks take this one's silence as its end
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)
