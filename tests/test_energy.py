"""The energy F(zeta): autodiff gives attention; distributed Algorithms 1-2; variance."""

import numpy as np
import pytest
import torch
from helpers import make_problem, world
from numpy.testing import assert_allclose

import mpitree
from mpitree.energy import attention_variance, free_energy, tree_energy


def qkv(seed, b=2, hq=6, hkv=2, sq=3, n=7, d=5, logit=1.0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((b, hq, sq, d)) * logit,
        rng.standard_normal((b, hkv, n, d)),
        rng.standard_normal((b, hkv, n, d)),
    )


def causal_visible(n):
    return np.tril(np.ones((n, n), dtype=bool))


def test_numpy_energy_at_zero_is_the_log_partition():
    q, k, v = qkv(0)
    _, ref_lse = mpitree.reference_attention(q, k, v)
    assert_allclose(free_energy(q, k, v), ref_lse, rtol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
def test_torch_autograd_of_energy_is_attention(causal):
    q, k, v = qkv(1, sq=7 if causal else 3)
    zeta = torch.zeros(q.shape, dtype=torch.float64, requires_grad=True)
    t = [torch.from_numpy(x) for x in (q, k, v)]
    f = free_energy(*t, zeta, causal=causal)
    f.sum().backward()
    ref, ref_lse = mpitree.reference_attention(
        q, k, v, visible=causal_visible(7) if causal else None
    )
    assert_allclose(zeta.grad.numpy(), ref, atol=1e-13, rtol=0)
    assert_allclose(f.detach().numpy(), ref_lse, rtol=1e-13)


def test_energy_does_not_depend_on_the_shift():
    q, k, v = qkv(2, logit=3.0)
    zeta = np.random.default_rng(3).standard_normal(q.shape)
    base = free_energy(q, k, v, zeta)
    for shift in (0.0, -5.0, np.random.default_rng(4).uniform(-3, 3, base.shape)):
        assert_allclose(free_energy(q, k, v, zeta, shift=shift), base, rtol=1e-12)
    with pytest.raises(ValueError, match="shift"):
        free_energy(q, k, v, shift="min")


def test_gradient_at_nonzero_zeta_matches_finite_differences():
    q, k, v = qkv(5, b=1, hq=2, hkv=1, sq=2, n=6, d=3)
    z0 = np.random.default_rng(6).standard_normal(q.shape) * 0.7
    zeta = torch.tensor(z0, requires_grad=True)
    free_energy(*(torch.from_numpy(x) for x in (q, k, v)), zeta).sum().backward()
    h = 1e-6
    fd = np.zeros_like(z0)
    for idx in np.ndindex(z0.shape):
        e = np.zeros_like(z0)
        e[idx] = h
        fd[idx] = (free_energy(q, k, v, z0 + e).sum() - free_energy(q, k, v, z0 - e).sum()) / (
            2 * h
        )
    assert_allclose(zeta.grad.numpy(), fd, atol=1e-8, rtol=1e-7)


def test_jax_grad_of_energy_is_attention():
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    q, k, v = qkv(7)
    grad = jax.grad(lambda z: free_energy(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), z).sum())(
        jnp.zeros(q.shape)
    )
    assert_allclose(np.asarray(grad), mpitree.reference_attention(q, k, v)[0], atol=1e-12)


def test_empty_rows_give_minus_inf_and_zero_gradient():
    q, k, v = qkv(8, sq=1)
    mask = np.ones((1, 1, 1, 7), dtype=bool)
    mask[..., :] = False
    zeta = torch.zeros(q.shape, dtype=torch.float64, requires_grad=True)
    f = free_energy(*(torch.from_numpy(x) for x in (q, k, v)), zeta, mask=torch.from_numpy(mask))
    f.sum().backward()
    assert torch.isneginf(f).all() and not torch.isnan(zeta.grad).any()
    assert (zeta.grad == 0).all()


NPROCS = [1, 2, 3]


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("algorithm", ["paper", "fused"])
@pytest.mark.parametrize("kw", [dict(), dict(q_len=2, positions=True, mask="head", kv_len=True)])
def test_distributed_energy_and_gradient(algorithm, kw):
    comm = world()
    prob = make_problem(
        9,
        [4, 0, 6][: comm.size] if comm.size < 3 else [4, 0, 6],
        dtype=np.float64,
        q_heads=4,
        kv_heads=2,
        **kw,
    )
    k, v, extra = prob.shard(comm.rank)
    zeta = np.random.default_rng(10).standard_normal(prob.q.shape) * 0.3
    energy, grad = tree_energy(prob.q, k, v, zeta=zeta, algorithm=algorithm, **extra)
    visible = prob.visible()
    ref = free_energy(prob.q, prob.k, prob.v, zeta, mask=visible)
    assert_allclose(energy, ref, rtol=1e-12)
    zt = torch.tensor(zeta, requires_grad=True)
    free_energy(
        *(torch.from_numpy(x) for x in (prob.q, prob.k, prob.v)),
        zt,
        mask=torch.from_numpy(np.broadcast_to(visible, (*energy.shape, sum(prob.sizes))).copy()),
    ).sum().backward()
    assert_allclose(grad, zt.grad.numpy(), atol=1e-12)
    # at zeta = 0 the energy path is exactly tree_decode's lse and output
    e0, g0 = tree_energy(prob.q, k, v, algorithm=algorithm, **extra)
    out, lse = mpitree.tree_decode(prob.q, k, v, return_lse=True, **extra)
    assert_allclose(g0, out, atol=1e-13)
    assert_allclose(e0.astype(np.float32), lse, rtol=1e-6)


@pytest.mark.parallel(nprocs=NPROCS)
@pytest.mark.parametrize("full", [False, True])
def test_attention_variance_is_the_covariance_of_v(full):
    comm = world()
    prob = make_problem(
        11,
        [5, 3, 0][: comm.size] if comm.size < 3 else [5, 3, 0],
        dtype=np.float64,
        q_heads=4,
        kv_heads=2,
        head_dim=6,
        mask="shared",
    )
    k, v, extra = prob.shard(comm.rank)
    out, var = attention_variance(prob.q, k, v, full=full, **extra)
    # float64 covariance of v under the softmax weights, from the whole cache
    b, hq, sq, d = prob.q.shape
    vis = np.broadcast_to(prob.visible(), (b, hq, sq, sum(prob.sizes)))
    g = hq // prob.k.shape[1]
    for bi, h, i in np.ndindex(b, hq, sq):
        s = prob.q[bi, h, i] @ prob.k[bi, h // g].T / np.sqrt(d)
        s = np.where(vis[bi, h, i], s, -np.inf)
        if not vis[bi, h, i].any():
            assert np.all(out[bi, h, i] == 0) and np.all(var[bi, h, i] == 0)
            continue
        w = np.exp(s - s.max())
        w /= w.sum()
        vv = prob.v[bi, h // g]
        mean = w @ vv
        cov = (vv - mean).T @ (w[:, None] * (vv - mean))
        assert_allclose(out[bi, h, i], mean, atol=1e-12)
        assert_allclose(var[bi, h, i], cov if full else np.diag(cov), atol=1e-12)


@pytest.mark.parallel(nprocs=[1, 2])
def test_bad_zeta_raises_on_every_rank():
    q, k, v = qkv(12)
    zeta = np.zeros((*q.shape[:-1], 9)) if world().rank == world().size - 1 else None
    with pytest.raises(ValueError):
        tree_energy(q, k, v, zeta=zeta)
