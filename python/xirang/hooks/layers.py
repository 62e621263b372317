"""Which modules count as the model's layers: the default finder, and its warning when the cut
is too coarse for communication to overlap backward."""
from __future__ import annotations

import logging
from typing import Dict, List

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _is_block_list(m: nn.Module) -> bool:
    """A ``ModuleList``/``Sequential`` of >= 2 blocks of one type, each a composite module (with
    parameterised children of its own): GPT-2's ``h``, Llama's ``layers``, BERT's ``encoder.layer``,
    ``TransformerEncoder.layers``, a ResNet stage, a ViT's ``blocks``. ``Sequential(Linear, ReLU,
    Linear)`` is not one (its elements are leaves)."""
    if not isinstance(m, (nn.ModuleList, nn.Sequential)):
        return False
    kids = [c for c in m.children() if _has_params(c)]
    return (len(kids) >= 2 and len({type(c) for c in kids}) == 1
            and all(any(_has_params(g) for g in c.children()) for c in kids))


def _cut(m: nn.Module) -> List[nn.Module]:
    """``m`` as one layer, unless it is a container or holds a block list somewhere beneath it:
    then its parameterised children, each cut the same way."""
    if not isinstance(m, _CONTAINERS) and not any(_is_block_list(x) for x in m.modules()):
        return [m]
    out: List[nn.Module] = []
    for c in m.children():
        if _has_params(c):
            out.extend(_cut(c))
    return out


def default_layers(root: nn.Module) -> List[nn.Module]:
    """The default layers of ``root``, in registration order: one layer per block.

    A module is split into its children (recursively) while it is a container (``ModuleList``,
    ``Sequential``, ``ModuleDict``) or holds a block list (:func:`_is_block_list`) beneath it; every
    other module with parameters is one layer. So HF GPT-2 gives ``transformer.wte``,
    ``transformer.wpe``, ``transformer.h.0`` .. ``h.N``, ``transformer.ln_f``, ``lm_head``; Llama
    ``model.embed_tokens``, ``model.layers.i``, ``model.norm``, ``lm_head``; BERT
    ``bert.embeddings``, ``bert.encoder.layer.i``, ...; an ``nn.TransformerEncoder`` anywhere in a
    model its ``layers.i``; a ResNet ``conv1``, ``bn1``, ``layer1.0`` .. ``layer4.k``, ``fc``.
    Parameters of a split module itself (a ViT's ``cls_token``, ``pos_embed``) are in no layer:
    they form the hook's last group. If that yields fewer than two layers, the leaf modules with
    parameters are the layers instead. Pass ``layers=`` to the hook's state to choose yourself.
    """
    layers = _cut(root)
    if len(layers) < 2:
        layers = [
            x for x in root.modules() if next(x.parameters(recurse=False), None) is not None
        ]
    return layers


def warn_if_coarse(layer_list: List[nn.Module], layer_params: List[List[nn.Parameter]],
                   n_groups: int, mod_names: Dict[int, str]) -> None:
    """WARNING on logger "xirang" when the default layers give too coarse a cut for overlap:
    fewer than 2 groups, or one layer holding more than half the parameters (a model whose blocks
    the finder cannot see). Names the ``layers=`` argument, with the block list found inside the
    largest layer as the example, or ``layers_per_group=`` when the layers are fine but one group
    takes them all."""
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
    if share > 0.5 and best is not None and mod_names.get(id(best), "<root>") != "<root>":
        example = f"layers=[*model.{mod_names[id(best)]}]"
    elif share <= 0.5 and len(layer_list) >= 2:
        example = f"layers_per_group={max(1, len(layer_list) // 4)}"
    else:
        example = "layers=[block_1, block_2, ...]"
    note = (" (model = the module DDP wraps; parameters in no listed layer form one last group)"
            if example.startswith("layers=") else "")
    logging.getLogger("xirang").warning(
        "xirang hook: the default layer finder gave %s, so little or no communication overlaps "
        "backward. Pass the layers or the group size yourself, e.g. register_comm_hook(ddp, %s)%s.",
        "; ".join(why), example, note)
