"""Declared data of mla-tune (parameter spaces, shape suites, tolerances), shipped with the
package so an installed mla-tune finds it; read through `mla_tune.space.load_toml`."""
