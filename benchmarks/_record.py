"""The 'recorded' block every benchmark result file carries: device, date, command, code."""
import sys
import time


def _without_note(argv):
    """The command line less its --note (the note is recorded on its own)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--note":
            skip = True
        elif not a.startswith("--note="):
            out.append(a)
    return out


def recorded(note):
    """Device, date, the command that made these numbers, and what code they measure."""
    import cupy

    return {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
            "date": time.strftime("%Y-%m-%d"),
            "command": "python3 " + " ".join(_without_note(sys.argv)),
            "code": note}
