"""`python -m experiments.kda_demo` at a small size: it prints each implementation's agreement
with the oracle, and the chunked op's is float32-tight for both gate forms."""

import re

import pytest

from experiments import kda_demo


@pytest.mark.slow
def test_kda_demo_prints_small_errors_for_both_gates(capsys):
    kda_demo.main(["--batch", "1", "--length", "100", "--heads", "2", "--dim", "16"])
    rows = re.findall(r"^(lower_bound|softplus)\s+(reference|chunked)\s+[\d.]+\s+(\S+)\s+(\S+)$",
                      capsys.readouterr().out, flags=re.M)
    errors = {(gate, impl): (float(o), float(s))
              for gate, impl, o, s in rows}
    assert set(errors) == {(gate, impl) for gate in ("lower_bound", "softplus")
                           for impl in ("reference", "chunked")}
    for (gate, impl), (error_o, error_state) in errors.items():
        if impl == "reference":
            assert error_o == error_state == 0.0
        else:
            assert 0.0 < error_o < 1e-4 and 0.0 < error_state < 1e-4, (gate, error_o, error_state)
