import numpy as np
import pytest

from pyro_trees.datasets import make_vart_causal_toy, simulate_ihdp_surface


@pytest.mark.parametrize("setting,means", [("partial", (40, 20)), ("overlap", (30, 40))])
def test_causal_toy(setting, means):
    d = make_vart_causal_toy(4000, setting, random_state=0)
    x, a = d["X"][:, 0], d["A"]
    assert d["X"].shape == (4000, 1) and set(np.unique(a)) == {0, 1}
    assert abs(x[a == 1].mean() - means[0]) < 1.0 and abs(x[a == 0].mean() - means[1]) < 1.0
    resid = d["y"] - np.where(a == 1, 90 + np.exp(0.06 * x), 72 + 3 * np.sqrt(np.clip(x, 0, None)))
    assert abs(resid.std() - 1) < 0.05
    assert np.allclose(d["f1"](x), d["mu1"]) and np.allclose(d["f0"](x), d["mu0"])
    again = make_vart_causal_toy(4000, setting, random_state=0)
    assert np.array_equal(again["y"], d["y"])
    with pytest.raises(ValueError, match="setting"):
        make_vart_causal_toy(10, "none")


@pytest.mark.parametrize("surface", ["linear", "nonlinear"])
def test_ihdp_surfaces_have_ate_four(surface):
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(size=(300, 6)), rng.binomial(1, 0.4, size=(300, 19))], axis=1)
    A = rng.binomial(1, 0.3, size=300)
    s = simulate_ihdp_surface(X, A, surface, random_state=1)
    assert s["ate"] == pytest.approx(4.0, abs=1e-9)
    assert np.array_equal(s["y"], np.where(A == 1, s["y1"], s["y0"]))
    allowed = [0, 1, 2, 3, 4] if surface == "linear" else [0, 0.1, 0.2, 0.3, 0.4]
    assert set(np.round(s["beta"], 6)) <= set(allowed)
    if surface == "linear":
        assert np.allclose(s["mu1"] - s["mu0"], 4.0)
    with pytest.raises(ValueError, match="surface"):
        simulate_ihdp_surface(X, A, "cubic")
    with pytest.raises(ValueError, match="N matching A"):
        simulate_ihdp_surface(X, A[:-1])
