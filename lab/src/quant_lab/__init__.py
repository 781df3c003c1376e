"""The quant-fsdp repository's lab: the demo (`quant_lab.demo`, run by `quant-fsdp demo`) and the
multi-process test worlds (`quant_lab.testing`) that the tests, benchmarks and docs use.

Not published: the nox sessions install it from the checkout (`pip install ./lab`). It imports
every package of the repository; no package imports it.
"""
