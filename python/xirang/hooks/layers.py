"""Which modules count as the model's layers: the default finder, and its warning when the cut
is too coarse for communication to overlap backward."""
from __future__ import annotations

import logging
from typing import Dict, List

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _expand_containers(m: nn.Module) -> List[nn.Module]:
    """A ModuleList/Sequential/ModuleDict stands for its children (recursively)."""
    if isinstance(m, _CONTAINERS):
        out: List[nn.Module] = []
        for c in m.children():
            if _has_params(c):
                out.extend(_expand_containers(c))
        return out
    return [m]


def default_layers(root: nn.Module) -> List[nn.Module]:
    """The default layers of ``root``, in registration order.

    Single-child wrappers without parameters of their own are looked through. Then each
    top-level child that holds parameters is a layer, except containers (``ModuleList``,
    ``Sequential``, ``ModuleDict``), whose children are the layers (a ``ModuleList`` of
    transformer blocks gives one layer per block). If that yields fewer than two layers, the
    leaf modules with parameters are the layers instead.
    """
    m = root
    while True:
        kids = [c for c in m.children() if _has_params(c)]
        own = next(m.parameters(recurse=False), None) is not None
        if len(kids) == 1 and not own and not isinstance(kids[0], _CONTAINERS):
            m = kids[0]
            continue
        break
    layers: List[nn.Module] = []
    for c in kids:
        layers.extend(_expand_containers(c))
    if len(layers) < 2:
        layers = [
            x for x in root.modules() if next(x.parameters(recurse=False), None) is not None
        ]
    return layers


def warn_if_coarse(layer_list: List[nn.Module], layer_params: List[List[nn.Parameter]],
                   n_groups: int, mod_names: Dict[int, str]) -> None:
    """WARNING on logger "xirang" when :func:`default_layers` cut the model too coarsely for
    overlap: fewer than 2 groups, or one layer holding more than half the parameters (e.g. HF
    ``GPT2LMHeadModel``: its ``transformer`` is one layer; an ``nn.TransformerEncoder`` between an
    embedding and a head). Names the ``layers=`` argument, with the block list found inside the
    largest layer as the example."""
    sizes = [sum(p.numel() for p in ps) for ps in layer_params]
    total = sum(sizes)
    if total == 0:
        return
    big = max(range(len(sizes)), key=sizes.__getitem__)
    share = sizes[big] / total
    if n_groups >= 2 and share <= 0.5:
        return
    why = [f"{len(layer_list)} layer(s) in {n_groups} group(s)"]
    if share > 0.5:
        why.append(f"'{mod_names.get(id(layer_list[big]), '?')}' ({type(layer_list[big]).__name__}) "
                   f"holds {share:.0%} of the parameters")
    # The example: the container of blocks (ModuleList/Sequential of >= 2 parameterised children)
    # with the most parameters inside the largest layer, named from the model's root.
    best, best_n = None, 0
    for m in layer_list[big].modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and sum(_has_params(c) for c in m.children()) >= 2:
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_n = m, n
    if best is not None and mod_names.get(id(best), "<root>") != "<root>":
        example = f"layers=[*model.{mod_names[id(best)]}]"
    else:
        example = "layers=[block_1, block_2, ...]"
    logging.getLogger("xirang").warning(
        "xirang hook: the default layer finder gave %s, so little or no communication overlaps "
        "backward. Pass the layers yourself, e.g. register_comm_hook(ddp, %s) (model = the module "
        "DDP wraps; parameters in no listed layer form one last group).", "; ".join(why), example)
