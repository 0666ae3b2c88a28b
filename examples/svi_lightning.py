"""Train your own Pyro model with a pyro_trees guide under PyTorch Lightning.

The route is Pyro's own for Lightning: with ``pyro.settings.set(module_local_params=True)``
the parameters live in the modules, ``Trace_ELBO()(model, guide)`` is an ``nn.Module``
whose ``forward`` is the loss, and a ``LightningModule`` wraps it; Lightning then runs
the loop, the devices and the processes (``--devices 2``: two processes with the
``ddp`` strategy, each with its shard of the rows through Lightning's
``DistributedSampler``).

The model is a user's own: VaRT's tree prior (:meth:`VaRT.sample_tree`) as the mean of
heavy-tailed Student-t observations, trained with :class:`~pyro_trees.guides.VaRTGuide`.
A batch holds only some of the rows; :meth:`Stream.scale` scales the sites of the plate
``data`` by ``num_rows / batch size``, so the loss is the ELBO of all the rows.

Run: ``python examples/svi_lightning.py`` (``--devices 2`` for two CPU processes;
needs ``pip install pyro_trees[distributed]``).
"""

from __future__ import annotations

import argparse

import pyro
import pyro.distributions as dist
import pytorch_lightning as pl
import torch
from pyro.nn import PyroParam
from torch.distributions import constraints
from torch.utils.data import DataLoader, TensorDataset

from pyro_trees.guides import VaRTGuide
from pyro_trees.infer import Stream
from pyro_trees.models import VaRT, tree_mean


class StudentTTree(VaRT):
    """A user's model: a VaRT tree as the regression function, Student-t noise."""

    def __init__(self, in_features: int, df: float = 4.0):
        super().__init__(in_features)
        self.df = df
        self.noise = PyroParam(torch.tensor(0.5), constraints.positive)

    def forward(self, x, y=None, subsample_size=None):
        tree = self.sample_tree(x.shape[0], like=x)
        with pyro.plate("data", x.shape[0], subsample_size=subsample_size, dim=-1) as idx:
            mean = tree_mean(tree, x[idx])
            obs = None if y is None else y[idx]
            return pyro.sample("obs", dist.StudentT(self.df, mean, self.noise), obs=obs)


class SVIModule(pl.LightningModule):
    """An ELBO module (``Trace_ELBO()(model, guide)``) trained by Lightning."""

    def __init__(self, elbo: torch.nn.Module, rows: Stream, lr: float = 0.01):
        super().__init__()
        self.elbo, self.rows, self.lr = elbo, rows, lr

    def training_step(self, batch, batch_idx):
        with self.rows.scale():  # the batch stands for all the rows
            loss = self.elbo(*batch)
        self.log("elbo_loss", loss, prog_bar=True, batch_size=len(batch[0]))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.elbo.parameters(), lr=self.lr)


def synthetic(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen)
    f = torch.where(x[:, 0] > 0, 1.0, -1.0) + 0.5 * x[:, 1]
    noise = 0.2 * torch.distributions.StudentT(3.0).sample((n,))
    return x, f + noise, f


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description="VaRT-based model under Lightning")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args(argv)

    pyro.settings.set(module_local_params=True)
    pl.seed_everything(0, verbose=False)
    x, y, f = synthetic(args.rows)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
    rows = Stream(loader, num_rows=args.rows)

    model = StudentTTree(x.shape[1])
    guide = VaRTGuide(model, depth=2)
    elbo = pyro.infer.Trace_ELBO()(model, guide)
    elbo(x[: args.batch_size], y[: args.batch_size])  # creates the lazy parameters

    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(SVIModule(elbo, rows), train_dataloaders=loader)

    with torch.no_grad(), guide.temperature_set_to(0.0):
        tree = guide.model.sample_tree  # the guide's tree, replayed into the prior's sites
        trace = pyro.poutine.trace(guide).get_trace(x)
        fitted = tree_mean(pyro.poutine.replay(tree, trace=trace)(like=x), x)
    rmse = float((fitted - f).pow(2).mean().sqrt())
    if trainer.is_global_zero:
        print(f"RMSE of the fitted function: {rmse:.3f} (noise scale 0.2, f's std {f.std():.2f})")
    return rmse


if __name__ == "__main__":
    main()
