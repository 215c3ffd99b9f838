"""Starting and supervising the processes of a run on this machine (outside any rank).

- :mod:`.spawn`: a rank's environment, one process per rank with its log, teardown;
- :mod:`.local`: the plain launcher (one torch.distributed world; kernel link emulation set-up);
- :mod:`.sites`: the elastic launcher (a job per site, a supervised Lighthouse, fault injection).
"""
