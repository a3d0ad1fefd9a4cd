#!/usr/bin/env python
"""Django's command-line utility for the Pitstop control plane (installed: ``pitstop-manage``)."""

from controlplane.manage import main

if __name__ == "__main__":
    main()
