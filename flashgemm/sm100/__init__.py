"""Blackwell (sm_100a / sm_103a) kernels."""
