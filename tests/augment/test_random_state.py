import multiprocessing

from augment import ProcessLocalRNG


def draw(rng):
    return rng().random(4).tolist()


def draw_into(rng, queue):
    queue.put(draw(rng))


def test_seeded_draws_are_reproducible():
    assert draw(ProcessLocalRNG(5)) == draw(ProcessLocalRNG(5))
    assert draw(ProcessLocalRNG(5)) != draw(ProcessLocalRNG(6))


def test_forked_workers_draw_different_numbers():
    rng = ProcessLocalRNG(5)
    context = multiprocessing.get_context('fork')
    queue = context.Queue()
    workers = [context.Process(target=draw_into, args=(rng, queue))
               for _ in range(2)]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=30) for _ in workers]
    for worker in workers:
        worker.join()
    # Without re-seeding, both workers would repeat the parent's next draw.
    parent_next = draw(rng)
    assert parent_next not in results
    assert results[0] != results[1]
