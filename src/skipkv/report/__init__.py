"""Reports from run dirs: tables (terminal, Markdown) and PNG plots. Reads records only; never runs a model.

    skipkv report runs/sweep_gsm8k --format both
    from skipkv.report import build_report; build_report([Path("runs/x")], Path("runs/x/report"))
"""

__all__ = ["FORMATS", "build_report"]


def __getattr__(name: str):
    # Lazy: `skipkv --help` imports report.cli, which should not pay for matplotlib.
    if name == "FORMATS":
        from skipkv.report.tables import FORMATS

        return FORMATS
    if name == "build_report":
        from skipkv.report.build import build_report

        return build_report
    raise AttributeError(name)
