"""Issue 27: an RL loop that drives add_request/step itself computes every step with the model's
weights as they are now, however they were changed, on every runner path (the fused native
decoder, the fused loop, transformers' forward on packed linears, transformers' own linears)."""
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from cb_kernels.runner.fused import forward
from tests.helpers import ATTN_BACKEND, make_model, random_prompts, reference_tokens

pytestmark = pytest.mark.one_thread

SYSTEM = random_prompts([24], seed=50)[0]        # 3 shared blocks of 8


def _optimizer_step(model, other):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(torch.tensor([SYSTEM]), labels=torch.tensor([SYSTEM])).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def _fused_adamw_step(model, other):
    """transformers Trainer's default optimizer (`adamw_torch_fused`, TRL's too): its fused kernel
    writes the parameters without bumping their version counters, so only the optimizer step hook
    can tell."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model(torch.tensor([SYSTEM]), labels=torch.tensor([SYSTEM])).loss.backward()
    versions = [p._version for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    assert [p._version for p in model.parameters()] == versions   # the case this guards


def _mul(model, other):
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
        model.model.norm.weight.mul_(0.5)


def _load(model, other):
    model.load_state_dict(other.state_dict())


def _load_assign(model, other):
    model.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)


def _attribute(model, other):
    layer, new = model.model.layers[1], other.model.layers[1]
    layer.mlp.down_proj.weight = torch.nn.Parameter(new.mlp.down_proj.weight.detach().clone())
    layer.self_attn.q_proj.weight = torch.nn.Parameter(new.self_attn.q_proj.weight.detach().clone())
    layer.input_layernorm.weight = torch.nn.Parameter(layer.input_layernorm.weight.detach() * 2)
    model.lm_head.weight = torch.nn.Parameter(other.lm_head.weight.detach().clone())


def _data_assign(model, other):
    for p, q in zip(model.parameters(), other.parameters()):
        p.data = q.detach().clone()


def _module(model, other):
    """New submodules (their Parameters new with them): an MLP projection and a norm."""
    layer, new = model.model.layers[0], other.model.layers[0]
    down = torch.nn.Linear(128, 64, bias=False)
    down.load_state_dict(new.mlp.down_proj.state_dict())
    layer.mlp.down_proj = down
    norm = type(layer.post_attention_layernorm)(64, eps=layer.post_attention_layernorm.variance_epsilon)
    norm.load_state_dict(new.post_attention_layernorm.state_dict())
    layer.post_attention_layernorm = norm


CHANGES = {"optimizer_step": _optimizer_step, "fused_adamw_step": _fused_adamw_step, "mul_": _mul, "load_state_dict": _load,
           "load_state_dict_assign": _load_assign, "attribute": _attribute,
           "data_assign": _data_assign, "module": _module}
PATHS = {"native": {}, "fused_loop": {"native": False},
         "transformers_packed": {"cfg": {"greedy_head": False}, "no_fused": True},
         "unpacked": {"cfg": {"pack_weights": False, "greedy_head": False}}}


def make_engine(model, overlap="off", **cfg):
    cfg = {"block_size": 8, "num_blocks": 64, "max_batch_tokens": 64, "overlap": overlap,
           "attention_backend": ATTN_BACKEND, **cfg}
    return Engine(model, EngineConfig(**cfg))


def drive(engine, prompts, max_new_tokens=6) -> list:
    """The RL worker's loop: add_request, then step() until every output came back."""
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens)) for p in prompts]
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
        engine.check_invariants()
    return [outs[i].token_ids for i in ids]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("change", CHANGES)
def test_step_follows_every_kind_of_weight_change(change, path):
    model, other = make_model(seed=3), make_model(seed=4)
    opts = PATHS[path]
    engine = make_engine(model, **opts.get("cfg", {}))
    if opts.get("no_fused"):
        engine.runner.fused = None
    old_native = forward.NATIVE
    forward.NATIVE = opts.get("native", True)
    try:
        first = random_prompts([3, 9], seed=41, prefix=SYSTEM)
        assert drive(engine, first) == reference_tokens(model, first, 6)
        CHANGES[change](model, other)
        then = random_prompts([5, 2], seed=42, prefix=SYSTEM)   # the same prefix: cache hits
        assert drive(engine, then) == reference_tokens(model, then, 6)
        # and again, with nothing changed: the prefix cache serves the new weights' KV
        again = random_prompts([4], seed=43, prefix=SYSTEM)
        hits = engine.stats()["prefix_hit_blocks"]
        assert drive(engine, again) == reference_tokens(model, again, 6)
        assert engine.stats()["prefix_hit_blocks"] > hits
    finally:
        forward.NATIVE = old_native
    assert engine.stats()["used_blocks"] == 0


def test_data_copy_needs_weights_updated():
    """The one documented case: `p.data.copy_` moves neither address nor version counter."""
    model, other = make_model(seed=3), make_model(seed=4)
    engine = make_engine(model)
    first = random_prompts([3], seed=41, prefix=SYSTEM)
    drive(engine, first)
    version = engine.weight_version
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters()):
            p.data.copy_(q)
    engine.weights_updated()
    assert engine.weight_version == version + 1
    then = random_prompts([5], seed=42, prefix=SYSTEM)
    assert drive(engine, then) == reference_tokens(model, then, 6)


def test_only_registrations_into_the_model_make_a_step_walk_its_tree():
    """transformers' decoders slice their ModuleList every forward (`self.layers[:n]` registers
    each layer into a new ModuleList): that must not make the next step walk the model's module
    tree (0.2 ms a step on a 4-layer model); a submodule put into the model must."""
    model = make_model(seed=3)
    engine = make_engine(model)
    drive(engine, random_prompts([3], seed=41))
    assert not engine.weights.replaced
    torch.nn.ModuleList(model.model.layers)[:1]        # registrations outside the model's tree
    assert not engine.weights.replaced
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(128, 64, bias=False)
    assert engine.weights.replaced
