"""Rewriters: one module per target; each turns one classified weight into its output tensors."""
