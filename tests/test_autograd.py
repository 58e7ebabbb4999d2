"""Gradients of torch.ops.moe_compile.fused_moe (moe_compile/autograd.py, kernels/cpu/backward.py).

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.
"""

from __future__ import annotations

import pytest
import torch

from moe_compile import ops  # noqa: F401  registers the op and its autograd
from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.reference import fused_moe_reference

ROLES = ("fc1", "fc1_up", "fc2", "fc1_bias", "fc1_up_bias", "fc2_bias")


def make_experts(E, H, F, gate_up="concat", stacked=True, transposed=False, bias=False,
                 dtype=torch.float64, seed=0, stacked_bias=None):
    """Role name -> list of leaf tensors (requires_grad) in the requested layout.

    Biases follow the weights (one stacked [E, n] tensor or E x [n]) unless ``stacked_bias`` says.
    """
    stacked_bias = stacked if stacked_bias is None else stacked_bias
    gen = torch.Generator().manual_seed(seed)
    f1 = F if gate_up in ("none", "separate") else 2 * F

    def weight(out_dim, in_dim):
        shape = (in_dim, out_dim) if transposed else (out_dim, in_dim)
        full = torch.randn(E, *shape, generator=gen, dtype=torch.float64) / in_dim**0.5
        return [full.to(dtype)] if stacked else [full[e].to(dtype) for e in range(E)]

    def bias_of(n):
        full = 0.1 * torch.randn(E, n, generator=gen, dtype=torch.float64)
        return [full.to(dtype)] if stacked_bias else [full[e].to(dtype) for e in range(E)]

    roles = {r: [] for r in ROLES}
    roles["fc1"] = weight(f1, H)
    roles["fc2"] = weight(H, F)
    if gate_up == "separate":
        roles["fc1_up"] = weight(F, H)
    if bias:
        roles["fc1_bias"] = bias_of(f1)
        roles["fc2_bias"] = bias_of(H)
        if gate_up == "separate":
            roles["fc1_up_bias"] = bias_of(F)
    for role in roles.values():
        for t in role:
            t.requires_grad_(True)
    return roles


def make_routing(T, E, K, dtype=torch.float64, used=None, seed=1):
    """ids [T, K] (distinct experts per token, drawn from the first `used` experts) and weights."""
    gen = torch.Generator().manual_seed(seed)
    used = E if used is None else used
    ids = torch.stack([torch.randperm(used, generator=gen)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    weights = torch.rand(T, K, generator=gen, dtype=torch.float64).to(dtype) + 0.1
    return ids.long(), weights.requires_grad_(True)


def call_op(x, ids, tw, roles, attrs: FFNAttrs, train=False):
    """``fused_moe`` (backward recomputes FC1) or ``fused_moe_train``'s y (backward reads FC1's
    output saved by the forward): both must give the same, exact gradients."""
    op = torch.ops.moe_compile.fused_moe_train if train else torch.ops.moe_compile.fused_moe
    out = op(
        x, ids, tw, *[roles[r] for r in ROLES],
        attrs.gate_up, attrs.transposed, attrs.activation, attrs.limit, attrs.alpha, attrs.weight_on,
    )
    return out[0] if train else out


def call_reference(x, ids, tw, roles, attrs: FFNAttrs):
    w = ExpertWeights(*[tuple(roles[r]) for r in ROLES], transposed=attrs.transposed)
    return fused_moe_reference(x, ids, tw, w, attrs)


def run_gradcheck(T, H, F, E, K, attrs: FFNAttrs, stacked=True, bias=False, used=None, stacked_bias=None,
                  train=False):
    roles = make_experts(E, H, F, attrs.gate_up, stacked, attrs.transposed, bias, stacked_bias=stacked_bias)
    ids, tw = make_routing(T, E, K, used=used)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    lengths = [len(roles[r]) for r in ROLES]

    def fn(x, tw, *flat):
        rebuilt, i = {}, 0
        for r, n in zip(ROLES, lengths):
            rebuilt[r] = list(flat[i : i + n])
            i += n
        return call_op(x, ids, tw, rebuilt, attrs, train)

    flat = [t for r in ROLES for t in roles[r]]
    assert torch.autograd.gradcheck(fn, (x, tw, *flat), eps=1e-6, atol=1e-6, rtol=1e-4)


# -- gradcheck, float64 ------------------------------------------------------------------------

@pytest.mark.parametrize("gate_up", ["concat", "interleaved", "separate", "none"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
@pytest.mark.parametrize("transposed", [False, True], ids=["linear", "transposed"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("train", [False, True], ids=["recompute", "saved_fc1"])
def test_gradcheck_layouts(gate_up, stacked, transposed, bias, train):
    attrs = FFNAttrs(gate_up=gate_up, transposed=transposed)
    run_gradcheck(5, 6, 4, 4, 2, attrs, stacked=stacked, bias=bias, train=train)


@pytest.mark.parametrize("weight_on", ["output", "between", "input"])
@pytest.mark.parametrize("K", [1, 2, 6])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
def test_gradcheck_weight_on_and_k(weight_on, K, stacked):
    attrs = FFNAttrs(gate_up="concat", weight_on=weight_on)
    # the list form runs the training op: weight_on "input" saves FC1 of the scaled input
    run_gradcheck(5, 6, 4, max(4, K), K, attrs, stacked=stacked, bias=True, train=not stacked)


@pytest.mark.parametrize(
    "activation,limit,gate_up",
    [("gelu", 0.0, "concat"), ("gelu_tanh", 0.0, "separate"), ("relu", 0.0, "none"),
     ("silu", 0.0, "none"), ("silu", 0.7, "concat"), ("gptoss", 0.7, "interleaved")],
)
@pytest.mark.parametrize("train", [False, True], ids=["recompute", "saved_fc1"])
def test_gradcheck_activations(activation, limit, gate_up, train):
    attrs = FFNAttrs(gate_up=gate_up, activation=activation, limit=limit)
    run_gradcheck(5, 6, 4, 4, 2, attrs, bias=True, train=train)


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "list"])
@pytest.mark.parametrize("weight_on", ["output", "input"])
def test_gradcheck_zero_token_experts(stacked, weight_on):
    # ids drawn from experts {0, 1} only: experts 2..5 receive no token.
    attrs = FFNAttrs(gate_up="separate", weight_on=weight_on)
    run_gradcheck(5, 6, 4, 6, 2, attrs, stacked=stacked, bias=True, used=2, train=stacked)


@pytest.mark.parametrize("stacked,stacked_bias", [(True, False), (False, True)])
def test_gradcheck_mixed_bias_forms(stacked, stacked_bias):
    attrs = FFNAttrs(gate_up="separate")
    run_gradcheck(5, 6, 4, 4, 2, attrs, stacked=stacked, bias=True, stacked_bias=stacked_bias)


@pytest.mark.parametrize("T", [1, 7])
def test_gradcheck_odd_token_counts(T):
    run_gradcheck(T, 6, 4, 4, 2, FFNAttrs(gate_up="interleaved", transposed=True), stacked=False, bias=True)


@pytest.mark.parametrize("train", [False, True], ids=["recompute", "saved_fc1"])
def test_out_of_range_ids_get_no_gradient(train):
    roles = make_experts(4, 6, 4, bias=True)
    ids, tw = make_routing(5, 4, 2)
    ids[0, 1] = -1  # sentinel: contributes nothing (sorts before every segment: saved rows shift)
    ids[3, 0] = 4
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    call_op(x, ids, tw, roles, FFNAttrs(), train).square().sum().backward()
    assert tw.grad[0, 1] == 0 and tw.grad[3, 0] == 0
    assert torch.autograd.gradcheck(lambda x, tw: call_op(x, ids, tw, roles, FFNAttrs(), train), (x, tw))


def test_empty_batch_backward():
    roles = make_experts(4, 6, 4, stacked=False, bias=True)
    x = torch.zeros(0, 6, dtype=torch.float64, requires_grad=True)
    ids, tw = make_routing(0, 4, 2)
    call_op(x, ids, tw, roles, FFNAttrs()).sum().backward()
    assert x.grad.shape == (0, 6) and tw.grad.shape == (0, 2)
    assert all(t.grad is not None and not t.grad.any() for r in ROLES for t in roles[r])


# -- frozen weights and experts without tokens ---------------------------------------------------

def test_frozen_inputs_get_no_grad_and_idle_experts_get_zeros():
    E = 5
    roles = make_experts(E, 6, 4, gate_up="separate", stacked=False, bias=True)
    frozen = [roles["fc1"][1], roles["fc2_bias"][0], roles["fc1_up"][4]]
    for t in frozen:
        t.requires_grad_(False)
    ids, tw = make_routing(6, E, 2, used=3)  # experts 3 and 4 get no token
    tw.requires_grad_(False)  # frozen router
    x = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    call_op(x, ids, tw, roles, FFNAttrs(gate_up="separate")).square().sum().backward()
    assert tw.grad is None
    assert all(t.grad is None for t in frozen)
    for r in ROLES:
        for e, t in enumerate(roles[r]):
            if t.requires_grad:
                assert t.grad is not None and t.grad.shape == t.shape
                if e >= 3:
                    assert not t.grad.any(), f"{r}[{e}] got tokens' gradient without tokens"
                elif r in ("fc1", "fc2"):
                    assert t.grad.any()
    assert x.grad is not None and x.grad.any()


def test_stacked_frozen_role_and_idle_slices():
    roles = make_experts(4, 6, 4, stacked=True, bias=True, stacked_bias=False)
    roles["fc2"][0].requires_grad_(False)
    ids, tw = make_routing(5, 4, 2, used=2)
    x = torch.randn(5, 6, dtype=torch.float64)  # x needs no grad either
    call_op(x, ids, tw, roles, FFNAttrs()).sum().backward()
    assert roles["fc2"][0].grad is None and x.grad is None
    w1 = roles["fc1"][0].grad
    assert w1.shape == roles["fc1"][0].shape and not w1[2:].any() and w1[:2].any()
    assert all(not b.grad.any() for b in roles["fc2_bias"][2:])
    roles = make_experts(4, 6, 4, stacked=True, bias=True)  # stacked [E, n] biases
    call_op(x, ids, tw, roles, FFNAttrs()).sum().backward()
    b2 = roles["fc2_bias"][0].grad
    assert b2.shape == (4, 6) and not b2[2:].any() and b2[:2].any()


# -- against autograd through the reference ------------------------------------------------------

def _grads_op_and_reference(attrs, stacked, bias, dtype, ref_dtype, T=33, H=32, F=24, E=8, K=2):
    roles = make_experts(E, H, F, attrs.gate_up, stacked, attrs.transposed, bias, dtype=dtype, seed=3)
    ids, tw = make_routing(T, E, K, dtype=dtype, used=E - 1, seed=4)  # last expert idle
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5)).to(dtype).requires_grad_(True)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(6))
    leaves = [x, tw, *[t for r in ROLES for t in roles[r]]]
    y = call_op(x, ids, tw, roles, attrs)
    got = torch.autograd.grad(y, leaves, dy.to(dtype))
    # Reference on copies in ref_dtype (the same values), differentiated by plain torch autograd.
    ref_leaves = [t.detach().to(ref_dtype).requires_grad_(True) for t in leaves]
    ref_roles, i = {}, 2
    for r in ROLES:
        ref_roles[r] = ref_leaves[i : i + len(roles[r])]
        i += len(roles[r])
    y_ref = call_reference(ref_leaves[0], ids, ref_leaves[1], ref_roles, attrs)
    # The idle expert's tensors never enter the reference's graph: their gradient is zero.
    want = torch.autograd.grad(y_ref, ref_leaves, dy.to(ref_dtype), allow_unused=True, materialize_grads=True)
    return got, want


CASES = [
    (FFNAttrs(gate_up="concat"), True, False),
    (FFNAttrs(gate_up="interleaved", activation="gptoss", limit=1.0, weight_on="between"), True, True),
    (FFNAttrs(gate_up="separate", transposed=True, weight_on="input"), False, True),
    (FFNAttrs(gate_up="none", activation="gelu_tanh"), False, False),
]


@pytest.mark.parametrize("attrs,stacked,bias", CASES)
def test_matches_reference_autograd_fp32(attrs, stacked, bias):
    # fp32: both accumulate in fp32 but sum in different orders (segment GEMMs vs per-expert
    # index_add): a few ulps of the largest term -> atol 1e-5, rtol 1e-4.
    got, want = _grads_op_and_reference(attrs, stacked, bias, torch.float32, torch.float32)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("attrs,stacked,bias", CASES)
def test_matches_reference_autograd_bf16(attrs, stacked, bias):
    # bf16 inputs: the op accumulates in fp32 and rounds each gradient once to bf16 (8-bit
    # mantissa, relative step 2^-8 = 0.0039); the oracle is the fp32 reference on the same
    # bf16-representable values.  Bound: ||got - want|| <= 1e-2 ||want|| per tensor.
    got, want = _grads_op_and_reference(attrs, stacked, bias, torch.bfloat16, torch.float32)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        err = (g.float() - w).norm() / w.norm().clamp_min(1e-6)
        assert err < 1e-2, err


# -- torch.compile -------------------------------------------------------------------------------

def test_compiled_training_step_inductor():
    torch._dynamo.reset()
    attrs = FFNAttrs(gate_up="concat", weight_on="output")
    roles = make_experts(4, 16, 8, stacked=True, bias=True, dtype=torch.float32, seed=7)
    x = torch.randn(9, 16, requires_grad=True)
    ids, tw = make_routing(9, 4, 2, dtype=torch.float32, used=3)
    params = [t for r in ROLES for t in roles[r]]

    lengths = [len(roles[r]) for r in ROLES]

    def loss_fn(x, tw, *flat):
        rs, i = {}, 0
        for r, n in zip(ROLES, lengths):
            rs[r] = list(flat[i : i + n])
            i += n
        y = call_op(torch.tanh(x), ids, tw.softmax(-1), rs, attrs)
        return (y * y).mean()

    want = torch.autograd.grad(loss_fn(x, tw, *params), [x, tw, *params])
    compiled = torch.compile(loss_fn, backend="inductor", fullgraph=True)
    got = torch.autograd.grad(compiled(x, tw, *params), [x, tw, *params])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)

    # A full step: compiled forward + loss + backward, then an optimizer step.
    opt = torch.optim.SGD(params, lr=0.1)
    before = params[0].detach().clone()
    compiled(x, tw, *params).backward()
    opt.step()
    assert not torch.equal(before, params[0].detach())
    assert not params[0].grad[3].any()  # the idle expert's slice stays zero


@pytest.mark.parametrize("train", [False, True], ids=["recompute", "saved_fc1"])
@pytest.mark.parametrize("weight_on", ["output", "input"])
def test_gradcheck_across_chunks(monkeypatch, train, weight_on):
    # Chunks of at most 3 rows: experts are grouped several to a chunk, and an expert with more
    # rows than that is a chunk of its own — every boundary case of cpu.expert_chunks.
    from moe_compile.kernels.cpu import forward as cpu, backward as cpu_backward

    monkeypatch.setattr(cpu_backward, "CHUNK_ROWS", 3)
    monkeypatch.setattr(cpu, "CHUNK_ROWS", 3)
    attrs = FFNAttrs(gate_up="separate", weight_on=weight_on)
    run_gradcheck(7, 6, 4, 5, 2, attrs, stacked=False, bias=True, train=train)
