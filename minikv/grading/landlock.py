"""Landlock: what a submission's process may read and write, enforced by the kernel.

Landlock (Linux 5.13+) lets any process, root or not, give up access for itself and its future
children, for good. The grader's child calls `restrict` before it imports anything of the
submission's: from then on it may read only the paths it was given (Python, its libraries,
minikv's public modules; not the checks, the solutions or the repository's history), write only
in its private temporary folder, open no TCP connection, and signal or trace no process outside
its own domain (the grader included).

The child loads this file by its path before it imports any minikv module (see
`minikv.grading.child`), so it imports only the standard library.
"""

from __future__ import annotations

import ctypes
import os

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446  # the same number on every architecture
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
# Rights on files, by the ABI that introduced them; the rest of a version's rights apply to folders only.
FILE_RIGHTS = {1: EXECUTE | WRITE_FILE | READ_FILE, 3: 1 << 14, 5: 1 << 15}
ALL_FS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1   # ABI 4
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The Landlock ABI version this kernel offers; 0 where there is none (old kernel, not enabled)."""
    try:
        version = _libc().syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(version), 0)


def _rights(table: dict[int, int], version: int) -> int:
    if table is ALL_FS:  # cumulative: the largest set this version knows
        return max(v for k, v in table.items() if k <= version)
    return sum(v for k, v in table.items() if k <= version)


def restrict(read: list[str], write: list[str]) -> str:
    """Allow this process (and its children) to read only beneath `read`, to write only beneath
    `write`, no TCP, no signals or ptrace outside its domain. Paths that do not exist are skipped.
    Returns what is in force, in words; raises OSError where Landlock is missing or refuses."""
    version = abi()
    if version < 1:
        raise OSError("this kernel offers no Landlock")
    libc = _libc()
    handled = _rights(ALL_FS, version)
    attr = _RulesetAttr(handled, (NET_BIND_TCP | NET_CONNECT_TCP) if version >= 4 else 0,
                        (SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL) if version >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if version >= 6 else 16 if version >= 4 else 8
    fd = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset: " + os.strerror(ctypes.get_errno()))
    file_rights = _rights(FILE_RIGHTS, version)
    reading = READ_FILE | EXECUTE
    try:
        _add(libc, fd, "/", READ_DIR, file_rights)  # any folder may be listed (names only); files: below
        for path in read:
            _add(libc, fd, path, reading | READ_DIR, file_rights)
        for path in write:
            _add(libc, fd, path, handled, file_rights)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS): " + os.strerror(ctypes.get_errno()))
        if libc.syscall(SYS_RESTRICT_SELF, fd, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self: " + os.strerror(ctypes.get_errno()))
    finally:
        os.close(fd)
    net = ", no TCP" if version >= 4 else ""
    scope = ", no signals to the grader" if version >= 6 else ""
    return (f"Landlock ABI {version}: reads only Python and minikv's public modules, "
            f"writes only its own folder{net}{scope}")


def _add(libc, ruleset: int, path: str, access: int, file_rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not os.path.isdir(path):
            access &= file_rights  # a rule on a file may grant only rights that apply to files
        rule = _PathBeneath(access, fd)
        if libc.syscall(SYS_ADD_RULE, ruleset, RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}): " + os.strerror(ctypes.get_errno()))
    finally:
        os.close(fd)
