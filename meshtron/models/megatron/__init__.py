"""Megatron Core `torch_dist` checkpoints to and from meshtron checkpoints (`meshtron convert
megatron-to-meshtron` / `meshtron-to-megatron`): names and config arguments in `names`, the DCP files
in `dcp_files`, the two directions in `convert`. No import of megatron-core: the files are the contract.
"""
