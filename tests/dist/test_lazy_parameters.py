"""Parameters read one at a time (isoexec/dist/lazy_parameters.py): the weight sync's source holds one
whole parameter at a time, not the model's whole fp32 copy. ``GatheredParameters`` makes a value only
when it is read and tells shapes without reading; ``Engine.update_weights`` from it checks every name
and shape first, then reads, copies and drops one parameter at a time, with the bits of the update
from a dict; ``ShardedView`` (a tensor-parallel engine's ``shard_weights``) cuts each as it is read
and works out the cut's shape on the meta device."""

from __future__ import annotations

import sys
import weakref

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "engine"))
sys.modules.setdefault("fla", None)

import pytest  # noqa: E402
import torch  # noqa: E402

import tp_model_workers as tw  # noqa: E402
from engine_fixtures import tiny_model  # noqa: E402
from isoexec.bits import int_view  # noqa: E402
from isoexec.dist.lazy_parameters import GatheredParameters, ShardedView, shape_of  # noqa: E402
from isoexec.engine import Engine, EngineConfig  # noqa: E402
from isoexec.model import tp_dense  # noqa: E402


class _Source:
    """A ``GatheredParameters`` over a state dict whose ``gather`` makes a fresh copy at every read
    and watches how many of its copies are alive at once (the weight sync's peak)."""

    def __init__(self, state: dict):
        self.state, self.reads, self.alive, self.peak = state, [], [], 0

    def gather(self, name: str) -> torch.Tensor:
        self.alive = [r for r in self.alive if r() is not None]
        t = self.state[name].detach().clone()
        self.alive.append(weakref.ref(t))
        self.peak = max(self.peak, len(self.alive))
        self.reads.append(name)
        return t

    def mapping(self) -> GatheredParameters:
        return GatheredParameters({n: tuple(t.shape) for n, t in self.state.items()}, self.gather)


def test_gathered_parameters_make_a_value_only_when_read_and_tell_shapes_without_reading():
    src = _Source({"a": torch.ones(2, 3), "b": torch.zeros(4)})
    m = src.mapping()
    assert list(m) == ["a", "b"] and len(m) == 2 and "a" in m
    assert shape_of(m, "a") == (2, 3) and shape_of(m, "b") == (4,) and src.reads == []
    assert torch.equal(m["b"], torch.zeros(4)) and src.reads == ["b"]
    with pytest.raises(KeyError):
        m["c"]
    assert shape_of({"x": torch.zeros(5, 1)}, "x") == (5, 1)   # a plain dict: its tensor's shape


def test_engine_update_from_gathered_parameters_holds_one_at_a_time_and_equals_the_dict_update():
    new = tiny_model("isoexec", torch.float32, seed=2)
    want_model, got_model = tiny_model("isoexec", torch.float32, seed=1), tiny_model("isoexec", torch.float32, seed=1)
    cfg = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, num_pages=16)
    Engine(want_model, want_model.contract, cfg).update_weights(new.state_dict(), trainer_contract=new.contract)
    src = _Source({n: p.detach() for n, p in new.named_parameters()})
    Engine(got_model, got_model.contract, cfg).update_weights(src.mapping(), trainer_contract=new.contract)
    names = [n for n, _ in got_model.named_parameters()]
    assert src.reads == names, "each parameter read once, in the engine's order"
    assert src.peak == 1, f"{src.peak} whole parameters alive at once"
    for (n, a), (_, b) in zip(want_model.named_parameters(), got_model.named_parameters()):
        assert torch.equal(int_view(a.detach()), int_view(b.detach())), n


def test_engine_refuses_a_wrong_shape_before_reading_any_value():
    model = tiny_model("isoexec", torch.float32, seed=1)
    state = {n: p.detach() for n, p in model.named_parameters()}
    name = next(iter(state))
    src = _Source({**state, name: torch.zeros(3, 3)})
    engine = Engine(model, model.contract, EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, num_pages=16))
    with pytest.raises(ValueError, match=f"{name} has shape \\(3, 3\\)"):
        engine.update_weights(src.mapping(), trainer_contract=model.contract)
    assert src.reads == [] and engine.weight_version == 0


def test_sharded_view_cuts_when_read_and_tells_each_cut_shape_on_the_meta_device():
    model, _ = tw.model_and_contract(torch.float32)
    full = {n: p.detach() for n, p in model.named_parameters()}
    src = _Source(full)
    # rank 1 of 2's cut of the dense model's parameters (the tensor-parallel model's shard_weights)
    cut = lambda name, t: tp_dense.cut_parameter(model.cfg, 2, 1, name, t)  # noqa: E731
    view = ShardedView(src.mapping(), cut, set(full) - {"embed"})
    for name, t in full.items():
        want = t if name == "embed" else cut(name, t)
        assert shape_of(view, name) == tuple(want.shape), name
    assert src.reads == []
    name = "layers.0.o_weight"   # row-parallel: rank 1's K columns
    assert torch.equal(view[name], cut(name, full[name])) and src.reads == [name]
    assert view[name].shape[1] == full[name].shape[1] // 2
    assert view["embed"].shape == full["embed"].shape
