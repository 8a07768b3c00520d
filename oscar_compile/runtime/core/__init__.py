"""Bookkeeping without tensors: sequences, scheduler, pages, swap, staging. Imports only ``cache``."""
