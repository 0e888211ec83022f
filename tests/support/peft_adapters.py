"""PEFT adapters as the --merge-lora tests make them: a fine-tune's size, saved, and PEFT's own merge."""

from __future__ import annotations

from pathlib import Path

import torch


def saved_adapter(model, config, folder: Path, b_scale: float) -> dict[str, torch.Tensor]:
    """`model` wrapped by PEFT with LoRA `config` (init_lora_weights=False: a trained adapter's B is not zero),
    every lora_B scaled by b_scale (a fine-tune's size), saved in `folder`; returns PEFT's merge_and_unload
    state dict, the reference."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    peft_model.save_pretrained(folder)
    return {k: v.clone() for k, v in peft_model.merge_and_unload().state_dict().items()}
