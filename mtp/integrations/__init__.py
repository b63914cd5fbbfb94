"""Optional adapters to other libraries' models.

- :mod:`mtp.integrations.hf`: Hugging Face ``transformers`` models (``pip install mtp[hf]``):
  :func:`~mtp.integrations.hf.parallelize_hf`, :func:`~mtp.integrations.hf.load_hf_state_dict`,
  :func:`~mtp.integrations.hf.hf_state_dict`.

Each adapter is imported on demand (``import mtp.integrations.hf``), so mtp never needs the
other library to be installed.
"""
