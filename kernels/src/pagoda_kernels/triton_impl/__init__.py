"""Triton kernels. Importing any module here imports triton; decorate-time
``TRITON_INTERPRET`` decides whether they run compiled or interpreted."""
