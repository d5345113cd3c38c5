"""The Ascend gate: every kernel of ``triton_kernels`` through triton-ascend's lowering and BiSheng's memory
planning, offline (docs/ascend-gate.md). Tooling, not runtime: it runs in its own venv
(``.ci/ascend_gate.sh``), and nothing the server imports imports it."""
