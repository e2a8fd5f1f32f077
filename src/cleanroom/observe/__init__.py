"""Looking at runs: reports, charts, the HTML report, failures, metrics, logs, progress."""
