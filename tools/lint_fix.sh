#!/usr/bin/env bash
# Applies ruff's automatic fixes and formatting to src/ and tests/ (configured in pyproject.toml), so that
# tests/test_lint.py passes. Idempotent: run it again after a merge. What it cannot fix, `ruff check` then lists.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff="${RUFF:-ruff}"
"$ruff" check --fix --quiet src tests || true  # what stays is listed by the last command
"$ruff" format --quiet src tests
"$ruff" check --fix --quiet src tests || true  # formatting may leave imports to sort again
"$ruff" check src tests
