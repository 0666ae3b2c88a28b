"""The clustering benchmark's autoencoder starts (``benchmarks/_clustering.py``): the
Glorot-uniform start and greedy layer-wise denoising pretraining."""

import math

import pytest
import torch
from torch import nn

from benchmarks import _clustering


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    protos = (torch.rand(4, 784, generator=g) > 0.7).float()
    x = protos[torch.randint(4, (n,), generator=g)]
    return torch.where(torch.rand(n, 784, generator=g) < 0.05, 1 - x, x)


def test_glorot_start_bounds_every_layer_and_zeroes_its_bias():
    enc, dec = _clustering.make_networks("small", 10, 10)
    _clustering.glorot_(enc, dec)
    layers = [m for net in (enc, dec) for m in net.modules() if isinstance(m, nn.Linear)]
    assert len(layers) == 4
    for layer in layers:
        bound = math.sqrt(6 / (layer.in_features + layer.out_features))
        assert layer.weight.abs().max() <= bound and bool((layer.bias == 0).all())
        assert layer.weight.abs().max() > 0.9 * bound  # the uniform's range, not torch's


def test_layerwise_pretraining_trains_every_pair_and_lowers_the_reconstruction():
    x = _data()
    torch.manual_seed(0)
    enc, dec = _clustering.make_networks("small", 10, 10)
    before = [p.detach().clone() for p in (*enc.parameters(), *dec.parameters())]

    def bce():
        with torch.no_grad():
            logits = dec(enc(x)[0])
            return float(nn.functional.binary_cross_entropy_with_logits(logits, x))

    start = bce()
    gen = torch.Generator().manual_seed(0)
    _clustering.pretrain_layerwise(
        enc, dec, x, epochs=20, batch_size=16, lr=1e-3, dropout=0.2, generator=gen
    )
    after = list((*enc.parameters(), *dec.parameters()))
    # every layer of the stack moved, except the scale rows of the encoder's last layer
    moved = [not torch.equal(a, b) for a, b in zip(before, after, strict=True)]
    assert all(moved)
    head = enc.net[-1]
    assert torch.equal(head.weight[10:], before[2][10:])  # the scale half: not in the code
    assert bce() < start


def test_pretrain_takes_the_options_and_refuses_an_unknown_start():
    x = _data(32)
    _, _, codes, _ = _clustering.pretrain(
        x,
        arch="small",
        latent=10,
        num_clusters=10,
        epochs=1,
        batch_size=16,
        lr=1e-3,
        seed=0,
        init="glorot",
        layerwise_epochs=1,
    )
    assert codes.shape == (32, 10) and bool(torch.isfinite(codes).all())
    with pytest.raises(ValueError, match="init must be"):
        _clustering.pretrain(
            x,
            arch="small",
            latent=10,
            num_clusters=10,
            epochs=1,
            batch_size=16,
            lr=1e-3,
            seed=0,
            init="he",
        )
