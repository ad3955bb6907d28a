"""Durable writes, the run directory's lock, and outputs that replace only what is ours.

* :func:`write_atomic`: a file written under a temporary name, fsynced, renamed over the
  target, and the directory fsynced: after a crash or a power loss the target is the old or
  the new content, never a mix or an empty file.
* :func:`fsync_tree` / :func:`fsync_dir`: what a rename of a directory needs first.
* :class:`RunLock`: an exclusive ``flock`` on ``DIR/.lock`` for as long as a run trains there;
  a second run is refused, naming the holder (pid, host, start time, command).
* :func:`check_output_dir` and :func:`replace_dir`: a command's output directory is refused
  when it is a file, when it holds or lies inside one of the command's inputs, or, with a
  ``--force``, when it is not an earlier output of the same command (its marker file) or holds
  entries the command did not write; a new output is written next to the target and swapped
  in, so a failed run leaves the old output whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from focus_pretrain.errors import InputError


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory (its entries: a rename or a new file in it is on disk after this).
    A filesystem that cannot fsync directories is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # e.g. some network filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """fsync one file's data and metadata."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under ``root``, then every directory, deepest first."""
    directories = []
    for folder, _, files in os.walk(root):
        directories.append(folder)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                fsync_file(path)
    for folder in reversed(directories):
        fsync_dir(folder)


def write_atomic(path: str | os.PathLike, content: str | bytes) -> Path:
    """Write ``content`` to ``path`` durably: a temporary file in the same directory, fsynced,
    renamed over ``path``, the directory fsynced. The file gets the umask's mode (0644 for
    0022). Returns ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    data = content.encode() if isinstance(content, str) else content
    umask = os.umask(0)
    os.umask(umask)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 & ~umask)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # our own temporary file, never the target
        raise
    fsync_dir(path.parent)
    return path


class RunInUseError(InputError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """An exclusive lock on a run directory, held while a run trains there.

    ``flock`` on ``DIR/.lock``; the holder's pid, host, start time and command are written
    into it, so a refused second run names the holder. The operating system drops the lock
    when the holder dies (also by SIGKILL), so a crashed run never blocks the next. On a
    filesystem without ``flock`` support a warning says two runs are not prevented there.

    The lock file stays after a run, except where :meth:`release` is asked to discard a
    directory this lock created and nothing else wrote into (a run refused before it began
    leaves no empty run directory behind). A lock taken on a file that was unlinked meanwhile
    is dropped and taken again on the new file (the usual lock-file protocol), so removing
    the file never lets two runs hold the directory.
    """

    NAME = ".lock"

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / self.NAME
        self._fd: int | None = None
        self._created: list[Path] = []  # the folders acquire made, deepest first
        self._locked = False  # the flock held (not where the filesystem has none)

    def acquire(self, purpose: str = "training") -> RunLock:
        """Take the lock or raise :class:`RunInUseError` naming the holder (an
        :class:`InputError` when a file stands where the directory should be)."""
        self._created = _make_folders(self.directory)
        if not self.directory.is_dir():  # a file, or a link to nothing, on the way
            raise InputError(
                f"{self.directory} cannot be a run directory: it or a folder above it is a "
                "file; give another run.output_dir"
            )
        fd = self._lock_current_file()
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "purpose": purpose,
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd
        return self

    def _lock_current_file(self) -> int:
        """An open descriptor of ``DIR/.lock`` holding its ``flock`` (the file now at the
        path: a lock won on a file another process unlinked meanwhile is taken again)."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # its holder discarded the directory meanwhile
                self.directory.mkdir(parents=True, exist_ok=True)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunInUseError(
                    f"{self.directory} is in use by another run ({holder_of(self.path)}): "
                    "wait for it to end, stop it, or choose another run.output_dir"
                ) from None
            except OSError as err:  # no lock support here (some network filesystems)
                print(
                    f"focus-pretrain: warning: cannot lock {self.path} ({err.strerror}): two "
                    "runs in this directory are not prevented on this filesystem",
                    file=sys.stderr,
                    flush=True,
                )
                self._locked = False
                return fd
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    self._locked = True
                    return fd
            except FileNotFoundError:
                pass  # unlinked by its last holder: lock the new file
            os.close(fd)
            if not self.directory.is_dir():
                self.directory.mkdir(parents=True, exist_ok=True)

    def release(self, discard_if_unused: bool = False) -> None:
        """Drop the lock (the file stays). ``discard_if_unused``: when :meth:`acquire` made
        the run directory and it holds nothing but the lock file, remove both, and the empty
        folders above it that acquire made (a run refused before it wrote anything)."""
        if self._fd is None:
            return
        unused = discard_if_unused and self._created and _only_entry(self.directory, self.NAME)
        if unused and self._locked:  # unlinked only while locked: a waiting run retakes it
            with contextlib.suppress(OSError):
                self.path.unlink()
                for folder in self._created:
                    folder.rmdir()  # only an empty folder: anything written there stays
        if self._locked:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        self._created = []

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunLock:
        return self.acquire() if not self.held else self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _make_folders(directory: Path) -> list[Path]:
    """Make ``directory`` and its missing parents; returns, deepest first, exactly the folders
    this call made (a folder another process makes meanwhile is not among them; a file or a
    dangling link on the way stops it, making nothing below)."""
    missing = [p for p in (directory, *directory.parents) if not p.exists()]
    made: list[Path] = []
    for folder in reversed(missing):  # outermost first
        try:
            folder.mkdir()
        except FileExistsError:
            if not folder.is_dir():
                break
            continue  # someone else's: never ours to remove
        except (NotADirectoryError, FileNotFoundError):
            break
        made.append(folder)
    return made[::-1]


def _only_entry(directory: Path, name: str) -> bool:
    """Whether ``name`` is the only entry of ``directory``."""
    try:
        return [entry.name for entry in os.scandir(directory)] == [name]
    except OSError:
        return False


def holder_of(lock_file: Path) -> str:
    """Who holds ``lock_file``, as written by :meth:`RunLock.acquire`."""
    try:
        info = json.loads(Path(lock_file).read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "holder unknown"
    return (
        f"{info.get('purpose', 'a run')}: pid {info.get('pid')} on {info.get('host')} since "
        f"{info.get('started')}, command: {info.get('command')}"
    )


def is_locked(directory: str | os.PathLike) -> str | None:
    """The holder of ``directory``'s run lock when a live process holds it, else ``None``."""
    path = Path(directory) / RunLock.NAME
    if not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # a refused run discarded its directory meanwhile
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return holder_of(path)
    except OSError:
        return None
    finally:
        os.close(fd)  # closing drops a lock we took
    return None


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_not_overlapping(out: Path, inputs: Iterable[tuple], what: str) -> None:
    """Refuse ``out`` when it is, holds or lies inside one of ``inputs``: ``(label, path)``,
    or ``(label, path, "may_hold_output")`` for an input ``out`` may lie inside (a run
    directory holding its export). Writing there could replace the input or pollute it.
    Paths are compared resolved; a ``None`` path is skipped."""
    target = Path(out).resolve()
    for label, path, *mode in inputs:
        if path is None:
            continue
        source = Path(path).resolve()
        holds, inside = _within(source, target), _within(target, source)
        if not (holds or (inside and "may_hold_output" not in mode)):
            continue
        relation = "is" if source == target else ("holds" if holds else "lies inside")
        raise InputError(
            f"{what} directory {out} {relation} {label} {path}: writing there could replace or "
            "pollute it; choose a directory outside it"
        )


def check_output_dir(
    out: str | os.PathLike,
    *,
    force: bool,
    marker: str | tuple[str, ...],
    what: str,
    owned: Callable[[Path], set[str] | None],
    inputs: Iterable[tuple] = (),
    option: str = "--force",
) -> None:
    """Whether a command may write its output directory ``out``; raises :class:`InputError`
    with the reason and the fix, before anything is touched:

    * ``out`` is a file (or another non-directory);
    * ``out`` is, holds or lies inside one of ``inputs`` (:func:`check_not_overlapping`);
    * ``out`` is a non-empty directory and not ``force``;
    * with ``force``: ``out`` carries no ``marker`` (it is not an earlier output of this
      command; a tuple: any of them, e.g. a full or an adapter-only export), or holds entries
      the earlier output did not write (``owned(out)``: the names it wrote, ``None`` when the
      marker is unreadable), named in the refusal;
    * ``out`` or a directory in it is a run directory in use (its lock is held).
    """
    out = Path(out)
    check_not_overlapping(out, inputs, what)
    if out.exists() and not out.is_dir():
        raise InputError(f"{what} directory {out} is a file: choose a directory path")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise InputError(
            f"{what} directory {out} exists and is not empty: choose a new directory, or pass "
            f"{option} to "
            f"replace an earlier {what} there"
        )
    markers = (marker,) if isinstance(marker, str) else marker
    marker = next((name for name in markers if (out / name).is_file()), None)
    if marker is None:
        raise InputError(
            f"{option} replaces only an earlier {what} (a directory with "
            f"{' or '.join(markers)}); {out} has none, so it holds someone else's files: "
            "choose another directory, or empty it yourself"
        )
    mine = owned(out)
    if mine is None:
        raise InputError(
            f"{out / marker} is unreadable, so which files in {out} this command wrote is "
            f"unknown; {option} replaces nothing it did not write: choose another directory"
        )
    foreign = sorted(p.name for p in out.iterdir() if p.name not in mine and p.name != marker)
    if foreign:
        listed = ", ".join(foreign[:5]) + (f" (+{len(foreign) - 5} more)" * (len(foreign) > 5))
        raise InputError(
            f"{out} holds files the earlier {what} did not write ({listed}); {option} replaces "
            "only what it wrote: move them out, or choose another directory"
        )
    for directory in [out, *(p for p in out.iterdir() if p.is_dir())]:  # e.g. OUT/run
        holder = is_locked(directory)
        if holder is not None:
            raise RunInUseError(f"{directory} is in use ({holder}): wait for it to end, or stop it")


@contextlib.contextmanager
def partial_dir(target: Path) -> Iterator[Path]:
    """A fresh temporary directory next to ``target`` for its new content (same filesystem,
    so the swap by :func:`replace_dir` is a rename), removed if the block fails (a kill
    leaves it: the leftovers of this host's dead processes are removed on the next use)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.partial-{socket.gethostname()}-"
    for stale in target.parent.glob(f"{prefix}*"):
        pid = stale.name[len(prefix) :]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)  # ours: a killed earlier attempt's
    path = target.parent / f"{prefix}{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)  # gone already once swapped in


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def replace_dir(new: Path, target: Path) -> Path:
    """Swap the complete directory ``new`` (from :func:`partial_dir`) in as ``target``: its
    files fsynced first; an existing ``target`` (checked by :func:`check_output_dir`) is
    exchanged with it in one atomic step where the system can (Linux ``renameat2``), else
    renamed aside first; the old content is deleted only once the new one is in place.
    Returns ``target``."""
    new, target = Path(new), Path(target)
    fsync_tree(new)
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()  # an empty directory: nothing to keep
    if not target.exists():
        os.rename(new, target)
        fsync_dir(target.parent)
        return target
    if _exchange(new, target):  # target now holds the new content, ``new`` the old
        old = new
    else:
        old = target.with_name(f".{target.name}.replaced-{os.getpid()}")
        os.rename(target, old)
        os.rename(new, target)
    fsync_dir(target.parent)
    shutil.rmtree(old)
    return target


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where
    the system or the filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return done == 0
