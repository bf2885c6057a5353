"""A PyTorch GPU workload for the GPU tests, the benchmarks and the demo.

Each process (a parent and --children workers, each with its own CUDA context; no NCCL) fills
--gib GiB of GPU memory with a deterministic pattern, then counts once per tick, running a kernel
over part of its memory every tick and a full checksum of its GPU memory every --verify-every
seconds. <dir>/<role>.state (JSON) holds count, the latest GPU digest and the count it was taken at;
<role>.digest holds the digest taken right after filling. A changed digest writes <role>.corrupt.

--train: each tick is also one step of a small deterministic training job (a seeded MLP, SGD, each step's batch
drawn from a generator seeded by the step's number), its loss appended to <role>.losses as "step loss.hex()".
--reference-losses N runs steps 1..N of that job alone in a fresh process and writes them the same way: a job
restored from a checkpoint taken at step S must log, for every later step, the very bits of that run.

  torch_counter.py --dir D --gib 4 --daemon   # prints the root pid once every process has filled
"""
import argparse
import json
import os
import sys
import time


def write_atomic(path, text):
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as fh:
        fh.write(text)
    os.rename(tmp, path)


CHUNK_ELEMS = 32 * 2**20  # int64 elements per checksum chunk (256 MiB)


def gpu_digest(torch, buf, weights):
    """Two int64 sums per 256 MiB chunk (plain and position-weighted), folded: catches changed and moved data."""
    s1 = torch.zeros((), dtype=torch.int64, device=buf.device)
    s2 = torch.zeros((), dtype=torch.int64, device=buf.device)
    for i in range(0, buf.numel(), CHUNK_ELEMS):
        c = buf[i:i + CHUNK_ELEMS]
        s1 += c.sum()
        s2 += (c * weights[:c.numel()]).sum() * (2 * (i // CHUNK_ELEMS) + 1)
    torch.cuda.synchronize()
    return "%016x%016x" % (s1.item() & (2**64 - 1), s2.item() & (2**64 - 1))


def fill(torch, dev, gib, seed):
    """A buffer of ``gib`` GiB on ``dev``, filled deterministically from ``seed``, and its weights."""
    n = int(gib * 2**30) // 8
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    buf = torch.empty(n, dtype=torch.int64, device=dev)
    for i in range(0, n, CHUNK_ELEMS):  # fill in pieces: randint on the whole buffer would need 2x memory
        m = min(CHUNK_ELEMS, n - i)
        buf[i:i + m] = torch.randint(-2**62, 2**62, (m,), generator=gen, device=dev, dtype=torch.int64)
    weights = torch.arange(1, CHUNK_ELEMS + 1, device=dev, dtype=torch.int64) * 2654435761
    return buf, weights


class Trainer(object):
    """One deterministic training step per call: the same steps on the same GPU give the same bits."""

    def __init__(self, torch, dev):
        torch.use_deterministic_algorithms(True)
        torch.manual_seed(1234)
        self.torch, self.dev = torch, dev
        self.model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)).to(dev)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def step(self, n):
        torch = self.torch
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(100000 + n)
        x = torch.randn(256, 512, generator=gen, device=self.dev)
        y = torch.randn(256, 1, generator=gen, device=self.dev)
        loss = ((self.model(x) - y) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()


def log_loss(path, step, loss):
    with open(path, "a") as fh:
        fh.write("%d %s\n" % (step, float.hex(loss)))


def reference_losses(args):
    import torch
    trainer = Trainer(torch, torch.device("cuda", int(str(args.device).split(",", 1)[0])))
    path = os.path.join(args.dir, "reference.losses")
    for n in range(1, args.reference_losses + 1):
        log_loss(path, n, trainer.step(n))


def run(role, args, on_ready):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (deterministic cuBLAS, before its first use)
    import torch
    # --device 0,1: one process holding memory on each GPU named (a DataParallel job's shape), --gib
    # split between them unevenly (the k-th GPU named holds k+1 shares), so nvidia-smi tells where each
    # part went; each part is seeded differently, so data that came back on the wrong GPU, or mixed,
    # changes the digest.
    devs = [torch.device("cuda", int(d)) for d in str(args.device).split(",")]
    seed = sum(map(ord, role)) + 7
    shares = len(devs) * (len(devs) + 1) // 2
    parts = [fill(torch, dev, args.gib * (k + 1) / shares, seed + 1000 * k) for k, dev in enumerate(devs)]

    def digest_all():
        return "+".join(gpu_digest(torch, buf, weights) for buf, weights in parts)
    digest0 = digest_all()
    dev = devs[0]
    if args.cache_gib:
        # What a training step leaves behind: blocks freed by the job that PyTorch's caching allocator
        # keeps reserved for reuse. A checkpoint saves them unless the job gives them back first.
        torch.ones(int(args.cache_gib * 2**30) // 8, dtype=torch.int64, device=dev)  # freed at once, kept reserved
        torch.cuda.synchronize()
    if args.quiesce:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
        import gpuckpt_quiesce
        gpuckpt_quiesce.install()
    write_atomic(os.path.join(args.dir, role + ".digest"), digest0)
    count, digest, digest_count, last_verify = 0, digest0, 0, time.monotonic()
    on_ready()
    probes = [buf[:2**20] for buf, _w in parts]
    trainer = Trainer(torch, dev) if args.train else None
    while True:
        count += 1
        if trainer is not None:
            log_loss(os.path.join(args.dir, role + ".losses"), count, trainer.step(count))
        # a kernel on every GPU every tick: blocks while the driver holds the lock
        probe_sum = sum(int(probe.sum().item()) for probe in probes)
        if time.monotonic() - last_verify >= args.verify_every:
            digest, digest_count, last_verify = digest_all(), count, time.monotonic()
            if digest != digest0:
                write_atomic(os.path.join(args.dir, role + ".corrupt"), "GPU digest changed at count %d\n" % count)
        write_atomic(os.path.join(args.dir, role + ".state"), json.dumps(
            {"count": count, "digest": digest, "digest_count": digest_count, "pid": os.getpid(),
             "device": ",".join(str(d) for d in devs), "gib": args.gib, "probe": probe_sum, "t": time.time()}))
        time.sleep(args.interval)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--children", type=int, default=0)
    ap.add_argument("--device", default="0", help="a GPU index, or several (0,1): memory on each")
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--verify-every", type=float, default=1.0)
    ap.add_argument("--cache-gib", type=float, default=0, help="GiB freed after the fill, kept by the allocator")
    ap.add_argument("--quiesce", action="store_true", help="release the allocator's cache on SIGUSR1 (gpuckpt_quiesce)")
    ap.add_argument("--daemon", action="store_true")
    ap.add_argument("--train", action="store_true", help="one deterministic training step per tick, its loss logged")
    ap.add_argument("--reference-losses", type=int, default=0, help="run steps 1..N of the training alone, log them")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.reference_losses:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        return reference_losses(args)
    out_w = None
    if args.daemon:
        r, w = os.pipe()
        if os.fork() > 0:
            os.close(w)
            pid = os.read(r, 32).decode().strip()
            print(pid, flush=True)
            os._exit(0 if pid else 1)
        os.close(r)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        log = os.open(os.path.join(args.dir, "workload.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        out_w = w
    # Fork the workers before CUDA is initialised (CUDA does not survive fork). The root pid is
    # reported only once every process has filled its GPU memory.
    readies = []
    for i in range(args.children):
        r, w = os.pipe()
        if os.fork() == 0:
            os.close(r)

            def child_ready(w=w):
                os.write(w, b"1")
                os.close(w)
            run("child%d" % (i + 1), args, child_ready)
        os.close(w)
        readies.append(r)

    def parent_ready():
        for r in readies:
            os.read(r, 1)
            os.close(r)
        if out_w is not None:
            os.write(out_w, str(os.getpid()).encode())
            os.close(out_w)
    run("parent", args, parent_ready)


if __name__ == "__main__":
    sys.exit(main())
