__version__ = "0.2.0"

def __getattr__(name):
    "`lucid_nb.load` imports `lucid_nb.predict` (torch, Lightning) on first use, so `import lucid_nb` stays light."
    if name == 'load':
        from lucid_nb.predict import load
        globals()['load'] = load
        return load
    raise AttributeError(f"module 'lucid_nb' has no attribute {name!r}")
