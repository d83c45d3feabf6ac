"""torchrun that exits 0 when a stop signal (SIGTERM, Ctrl-C) ended the run with a clean save.

    python tools/launch.py --nproc-per-node=8 pretrain_gpt.py +experiment=llama8b_8gpu

Takes exactly torchrun's arguments; see megand/tools/launch.py for what differs.
"""

from megand.tools.launch import main

if __name__ == "__main__":
    main()
