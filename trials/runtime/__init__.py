"""The process a trial runs in: its environment, its imports, its logs, its compiler limits.

    environ        environment variables set for a block only
    bytecode       whether torch and TE run from bytecode here or are compiled from source by every process
    compile_guard  TorchDynamo's recompile limit in processes that run many trials
    noise          third-party logs that are not the user's business, kept for -v

May import: the standard library (and torch's logging names). Nothing of JuicyTalk's own.
"""
