"""The masked tile order, shared by every arch: the integer rules
(``rules``), their pure-Python model that the tests check (``model``), and
the device walkers every kernel role runs (``walker``, ``nmajor``,
``dynamic``)."""
