"""The model as the trainer sees it: the parts this rank computes (one GPTModel, or its pipeline
stages) and one module that owns all their parameters under the single-process names, so the
optimizer and distributed checkpoints see `layers.7.mixer.wq.weight` whatever the layout."""

from __future__ import annotations

from torch import nn


class ModelParts(nn.Module):
    """A view over pipeline stage modules: registers their embedding/head/norm and the union of
    their `layers` (a ModuleDict keyed by the global sublayer index). Never called itself."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict()
        for part in parts:
            for name, child in part.named_children():
                if name == "layers":
                    self.layers.update(child)
                elif child is not None:
                    self.add_module(name, child)
        self.cfg = parts[0].cfg

    def forward(self, *args, **kwargs):
        raise RuntimeError("ModelParts only holds parameters; run the pipeline schedule instead")
