"""Old vs packed gather of one generation round's results under torchrun (NCCL), CUDA logprobs."""
import json, os, sys, time
import torch, torch.distributed as dist
from isoexec.engine.sequence import Result
from isoexec.rl import distributed as rl_dist
from isoexec.rl.result_gather import gather_results
torch.cuda.set_device(0); dist.init_process_group("nccl")
g = torch.Generator(device="cuda").manual_seed(0)
def results():
    return [Result(request_id=i, prompt=list(range(40)), ids=list(range(64)),
                   logprobs=-torch.rand(64, device="cuda", generator=g) * 5, finish_reason="length") for i in range(256)]
def old(rs):
    for r in rs:
        r.logprobs = r.logprobs.cpu()
    return rl_dist.all_gather(rs)
out = {}
for name, fn in (("old", old), ("packed", gather_results), ("old", old), ("packed", gather_results)):
    ts = []
    for _ in range(20):
        rs = results(); torch.cuda.synchronize()
        t = time.perf_counter(); got = fn(rs); ts.append(time.perf_counter() - t)
    ts.sort(); out[name] = {"median_ms": round(ts[10] * 1e3, 2), "min_ms": round(ts[0] * 1e3, 2)}
rs = results(); want = [r.logprobs.cpu() for r in rs]
(got,) = gather_results(rs)
out["differing_logprob_bits"] = int(sum((a.view(torch.int32) != b.logprobs.view(torch.int32)).sum() for a, b in zip(want, got)))
print("GATHER " + json.dumps(out)); json.dump(out, open(os.environ["OUT"] + "/gather_probe.json", "w"))
dist.destroy_process_group()
