"""The configuration's sections, one module per group of them; `ketch.config.schema` joins them into
`KetchConfig`."""
