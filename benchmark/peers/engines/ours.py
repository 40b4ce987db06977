"""This engine, one request at a time through its Scheduler (the loop the server's scheduler
process runs), a stamp per step that gave tokens back. Config: ServerArgs fields (dtype,
speculative_algorithm, ...). The radix cache is off, as prefix caching is for every peer."""

import time


def load(job):
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    cfg = dict(job["config"])
    longest = max(len(p["ids"]) for p in job["prompts"]) + job["new_tokens"] + 64
    sched = Scheduler(ServerArgs(model_path=job["model"], context_length=longest,
                                 max_total_tokens=longest + 1024, disable_radix_cache=True,
                                 num_threads=job["threads"], **cfg))
    sched.calibrate()  # as the server's scheduler process does at start-up
    count = [0]

    def run(ids, new_tokens):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        params.normalize()
        count[0] += 1
        start = time.perf_counter()
        sched.add_request(TokenizedGenerateReqInput(rid=f"peers-{count[0]}", input_ids=ids,
                                                    sampling_params=params, stream=True))
        stamps, out = [], []
        while not sched.is_idle():
            for u in sched.step():
                if u.new_output_ids:
                    stamps.append((time.perf_counter(), len(u.new_output_ids)))
                    out += u.new_output_ids
        sched.check_all_free()  # pools free after every request
        return start, stamps, out

    return run
