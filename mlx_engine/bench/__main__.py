import sys

from .. import _platform  # noqa: F401  (OpenBLAS before mlx)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["verify"]:
        from .verify import main as verify_main

        rc = verify_main(argv[1:])
        from .invariance import main as invariance_main  # a device property: reported, not tested

        return rc or invariance_main()
    if argv[:1] == ["ceiling"]:
        from .ceiling import main as ceiling_main

        return ceiling_main(argv[1:])
    if argv[:1] == ["distributed"]:
        from .distributed import main as distributed_main

        return distributed_main(argv[1:])
    from .suite import main as suite_main

    return suite_main(argv)


if __name__ == "__main__":
    sys.exit(main())
