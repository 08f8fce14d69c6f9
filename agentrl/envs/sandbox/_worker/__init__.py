"""The fork server that runs INSIDE a sandbox (stdlib only; run by the sandbox's own interpreter).

It is started once per pool worker (``python3 -I -c <isolation.WORKER_BOOTSTRAP> <this package as a zipapp>``, or
this package's directory in mode "none"), reads its config as the first frame on stdin, then answers requests from
the host on stdin/stdout (frames: 4-byte big-endian length + UTF-8 JSON). It forks a child per stateless run, so a
run costs a fork instead of an interpreter start, and keeps one long-lived kernel process per stateful session. It
must stay importable by old Pythons (3.8+): no third-party imports except libseccomp's binding, loaded only in a
short-lived child that builds the seccomp programs.

Requests (``op``):

- ``run`` {code, stdin, timeout, session, files, fetch_files, memory_bytes}: ``session`` None is stateless (a
  fresh child per run; ``memory_bytes`` may lower its memory limits); otherwise the key of a stateful kernel (a
  long-lived child keeping globals, started on first use). Answer: {stdout, stderr, exit_code, status,
  duration_s, truncated, display, event, error, files, reset, evicted}.
- ``close`` {session}: end that session's kernel. Answer: {ok}.

Every answer is followed by a health frame {health: bool, problems: [str], cleanup_s}: after answering, the
worker removes what the request left behind and checks that the sandbox is as clean as a fresh one. A worker
whose check fails refuses new stateless runs and sessions ({refused: reason}) and keeps serving its live
sessions, so that the host can replace it without losing them.

Isolation of one execution from every other (``mode`` "root" or "userns"):

- its own pid namespace (a stateless run is its pid 1, so the kernel ends every process of the run with it; a
  session's kernel is pid 2 under an init, the worker's child, that reaps orphans and reports the kernel's exit)
  and a ``/proc`` of it that lists its own processes only (``subset=pid``: no system-wide files);
- its own mount namespace with a private, size- and inode-capped tmpfs ``/tmp`` (the working directory) and
  ``/dev/shm``, and its own IPC namespace (SysV objects, POSIX message queues and semaphores); a session's
  kernel also gets its own network namespace, and stateless runs share one apart from the worker's (replaced
  when a run leaves unix sockets in flight). Everything dies with the execution's last process;
- its own memory cgroup (one for the stateless runs of this worker, one per session), so that memory, shared
  memory and tmpfs files count against the execution's limit and an OOM kill stays inside it; the worker's
  capacity is shared out so that every live session and the stateless runs keep a reserved share
  (:meth:`Worker.memory_for`);
- in "root" mode, its own uid, with its own part of the per-uid kernel quotas (POSIX queues, queued signals,
  locked memory): stateless runs take uids round-robin from the worker's block and a uid goes back only after
  the check verified that no task of it remains;
- no capabilities at all (effective, permitted, inheritable, ambient and bounding sets are empty), a seccomp
  filter (no sockets but AF_UNIX, no ptrace, namespaces, mounts, keyrings, kernel-module or BPF calls, and
  nothing that turns state the kernel shares between executions into a channel, see ``_add_channel_rules``),
  rlimits on address space, processes, file size, open files and CPU time (a session's kernel: per call);
- a wall-clock deadline: then every process of the call is SIGKILLed; after every call any process left
  (double-forked, setsid'd, or a process whose main thread exited while others run) is killed; a session's
  kernel is SIGSTOPped between calls, and checked to stay so (one that resumes itself is stopped again, what
  it started killed, and it is killed after half a CPU-second);
- stdout/stderr are capped per stream; the result frame the code's process writes is untrusted and validated
  (a session's carries the nonce of its request); the sandbox's own failures before any code runs travel on a
  status channel the code never holds.

"root" mode: the worker starts as root with CAP_SETUID/SETGID/SYS_ADMIN(/SYS_RESOURCE) inside bubblewrap, mounts
a plain ``/proc``, sizes the per-uid quotas, then moves into a user namespace of its own, owned by and mapped to an
unprivileged host uid (``uid_base``), with the code's uids mapped one-to-one; it continues as pid 1 of a pid
namespace that user namespace owns (so that it can give every execution one of its own) and from then on holds
no capability on the host. "userns" mode (the pool runs as an ordinary user): bubblewrap's user namespace maps
one uid, so code runs as the worker's uid. "none": no isolation at all (trusted code only).

Modules, by concern (imports go downward only): :mod:`.main` (entry point) -> :mod:`.startup` (once, before any
code) and :mod:`.seccomp` (the filters) -> :mod:`.worker` (requests, executions, cleanup) -> :mod:`.confine` (one
execution's namespaces and privileges) -> :mod:`.kernel` (a session's kernel) -> :mod:`.execute` (the code side),
:mod:`.cgroups`, :mod:`.procs` (process and pipe helpers) -> :mod:`.frames` and :mod:`.libc`. None imports this
package's ``__init__`` or anything outside the standard library (libseccomp's binding aside), so the package runs
inside the sandbox on its own.
"""
