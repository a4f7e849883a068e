"""Host cost of the same small work in this process: pure Python, a small CUDA op, an autograd
Function round trip, a CUDA graph replay. Run under python3 and torchrun to compare launchers."""
import gc, json, os, sys, threading, time
import torch
label = sys.argv[1]
if "--init" in sys.argv:
    import torch.distributed as dist
    torch.cuda.set_device(0); dist.init_process_group("nccl")
    x = torch.ones(1, device="cuda"); dist.all_reduce(x); torch.cuda.synchronize()
def best(f, reps=5):
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return round(min(ts) * 1e3, 2)
def pyloop():
    s = 0
    for i in range(1_000_000): s += i * i
a = torch.zeros(16, device="cuda"); torch.cuda.synchronize()
def cuda_add():
    for _ in range(10000): a.add_(1)
    torch.cuda.synchronize()
class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x * 2
    @staticmethod
    def backward(ctx, g): return g * 2
w = torch.zeros(16, device="cuda", requires_grad=True)
def fn_apply():
    for _ in range(3000): F.apply(w)
    torch.cuda.synchronize()
g = torch.cuda.CUDAGraph(); s = torch.cuda.Stream()
with torch.cuda.stream(s):
    for _ in range(3): a.add_(1)
torch.cuda.synchronize()
with torch.cuda.graph(g):
    for _ in range(200): a.add_(1)
def graph():
    for _ in range(200): g.replay()
    torch.cuda.synchronize()
res = {"label": label, "exe": sys.executable, "real": os.path.realpath(sys.executable), "pid": os.getpid(),
       "trace": repr(sys.gettrace()), "profile": repr(sys.getprofile()), "gc_threshold": gc.get_threshold(),
       "threads": threading.active_count(), "torch_threads": torch.get_num_threads(),
       "affinity": len(os.sched_getaffinity(0)), "nice": os.nice(0),
       "env": sorted(k for k in os.environ if k.startswith(("TORCH", "NCCL", "OMP", "MKL", "CUDA", "PYTHON", "LD_", "MALLOC", "RANK", "WORLD", "LOCAL", "MASTER", "GROUP", "ROLE")))}
for name, f in [("pyloop_ms", pyloop), ("cuda_add_10k_ms", cuda_add), ("fn_apply_3k_ms", fn_apply), ("graph_200_ms", graph)]:
    f(); res[name] = best(f)
print("PROBE " + json.dumps(res), flush=True)
