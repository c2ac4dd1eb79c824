"""``python -m mooncake doctor|demo``."""

from __future__ import annotations

import argparse
import os
import sys


def _check(label: str, fn) -> bool:
    try:
        detail = fn()
        print(f"  [ok]   {label}" + (f": {detail}" if detail else ""))
        return True
    except Exception as e:  # noqa: BLE001  (the doctor reports every failure)
        print(f"  [--]   {label}: {e}")
        return False


def doctor() -> int:
    """Prints what this installation can do here."""
    import platform

    import torch

    print("mooncake doctor")
    print(f"  python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}")
    from mooncake._loader import built_tags, load_extension

    ok = _check("extension loads", lambda: load_extension().build_info())
    if not ok:
        print(f"  built for torch: {built_tags() or 'nothing built'}")
        return 1
    ext = load_extension()
    info = ext.build_info()
    print(f"  build: module {info['module']}, CUDA kernels {'on' if info['cuda'] else 'off'}")
    print(f"  transports in this build: {', '.join(ext.TransferEngine.available_transports())}")

    def shm_ok():
        import mmap

        fd = os.memfd_create("mooncake-doctor")
        os.ftruncate(fd, 4096)
        again = os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR)
        m = mmap.mmap(again, 4096)
        m.close()
        os.close(again)
        os.close(fd)
        return "memfd segments can be mapped through /proc/<pid>/fd"

    _check("shm transport", shm_ok)

    def life_ok():
        page = ext.life_page()
        if not page["held"]:
            raise RuntimeError("no thread holds its word: a peer would take this process for dead")
        return (
            "a process's death is marked on a page of its own, which its peers' GPU kernels "
            f"read (this one's: /proc/{page['pid']}/fd/{page['fd']})"
        )

    _check("life page", life_ok)

    def tcp_ok():
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        c = socket.create_connection(s.getsockname(), timeout=2)
        c.close()
        s.close()
        host = os.environ.get("MOONCAKE_HOST_IP") or socket.gethostname()
        return f"loopback works; publishes {host}"

    _check("tcp transport", tcp_ok)
    from mooncake.pg import _rdma_devices

    rdma = _rdma_devices()
    has_ucx = "ucx" in ext.TransferEngine.available_transports()
    if not has_ucx:
        print("  [--]   ucx transport: not in this build (install libucx-dev and rebuild)")
    if rdma:
        use = "ucx uses them for other hosts" if has_ucx else "unused without the ucx transport"
        print(f"  RDMA devices: {rdma} ({use})")
    else:
        print("  RDMA devices: none (other hosts go over tcp; MOONCAKE_TRANSPORT=ucx for UCX)")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        names = [torch.cuda.get_device_name(i) for i in range(n)]
        print(f"  GPUs: {n} {names}")
        if n > 1:
            print(f"  peer access 0->1: {torch.cuda.can_device_access_peer(0, 1)}")
    else:
        print("  GPUs: none visible to torch (CUDA IPC unavailable)")
    import torch.distributed as dist

    from mooncake import pg  # noqa: F401

    print(f"  registered backends: {[b for b in dist.Backend.backend_list if 'mooncake' in b]}")
    print("  environment variables:")
    for name, default, doc in ext.env_registry():
        value = os.environ.get(name)
        shown = f"{value!r} (set)" if value is not None else f"default {default!r}"
        print(f"    {name} = {shown}\n        {doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mooncake")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="what this installation can do here")
    d = sub.add_parser("demo", help="a local group of CPU ranks")
    d.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor()
    from mooncake.demo import demo

    return demo(args.world_size)


if __name__ == "__main__":
    sys.exit(main())
