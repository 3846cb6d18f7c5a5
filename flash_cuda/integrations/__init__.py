"""Integrations of flash_cuda with other libraries."""
