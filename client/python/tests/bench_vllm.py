"""Engine update time per version with vLLM's own model classes on the CPU, TP 1 and TP 2, in
one run (docs/benchmarks.md): refit zero copy (wait + Status + Apply into the vLLM parameters,
as vLLM's weight-transfer backend `refit`) vs vLLM's own load_weights of the same checkpoint
(its tensors already in the engine process's memory) vs a memcpy of the rank's parameter bytes.

    REFITD=bazel-bin/daemon/refitd PYTHONPATH=client/python \\
        $(scripts/install/install-python-env.sh --print) client/python/tests/bench_vllm.py [VERSIONS]

Per TP size: the median over versions (the first is left out) of the slowest rank's time."""

import json
import os
import socket
import statistics
import subprocess
import sys

import vllm_models as vm

import refit
import refit.testing
from test_vllm import checkpoint_format

HERE = os.path.dirname(os.path.abspath(__file__))
KIND = "llama_bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(proc):
    while True:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"engine rank exited with {proc.wait()}")
        if line.startswith("{"):
            return json.loads(line)


def run(daemon, client, world, versions):
    name = f"bench-tp{world}"
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "vllm_tp_rank.py"), KIND, "0",
                               str(r), str(world), str(port), daemon.socket, name, "--bench",
                               "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env) for r in range(world)]
    try:
        ready = [read(p) for p in procs]
        assert all(r["zero_copy"] for r in ready), ready
        state = checkpoint_format(vm.hf_state_dict(KIND, 1))
        src = client.register(name, refit.SOURCE, state)
        rows = []
        for v in range(1, versions + 1):
            if v > 1:
                for t in src.tensors.values():
                    t.neg_()  # new values every version
            client.publish(name, v, [src])
            for p in procs:
                p.stdin.write(f"{v}\n")
                p.stdin.flush()
            rows.append([read(p) for p in procs])
        for p in procs:
            p.stdin.write("0\n")
            p.stdin.flush()
            p.wait(timeout=120)
        src.release()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = {"tp": world, "bytes_per_rank": rows[0][0]["bytes"]}
    for key in ("zero_copy_s", "load_weights_s", "memcpy_s"):
        out[key] = statistics.median(max(r[key] for r in row) for row in rows[1:])
    return out


def main():
    versions = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    daemon = refit.testing.Daemon()
    client = daemon.client()
    try:
        results = [run(daemon, client, world, versions) for world in (1, 2)]
    finally:
        client.close()
        daemon.stop()
    print(f"vLLM {__import__('vllm').__version__} {KIND} (bf16, CPU), per update, median of "
          f"{versions - 1} versions, slowest rank:")
    print("| TP | bytes per rank | memcpy | zero copy | load_weights | zero copy / load_weights |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['tp']} | {r['bytes_per_rank'] / 2**20:.1f} MiB | "
              f"{r['memcpy_s'] * 1e3:.1f} ms | {r['zero_copy_s'] * 1e3:.1f} ms "
              f"({r['zero_copy_s'] / r['memcpy_s']:.2f}x memcpy) | "
              f"{r['load_weights_s'] * 1e3:.1f} ms ({r['load_weights_s'] / r['memcpy_s']:.2f}x) | "
              f"{r['zero_copy_s'] / r['load_weights_s']:.2f} |")


if __name__ == "__main__":
    main()
