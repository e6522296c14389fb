package org.torchrecserve.plugin;

import java.util.List;
import java.util.concurrent.TimeUnit;
import org.pytorch.serve.wlm.Model;
import org.pytorch.serve.wlm.WorkerState;
import org.pytorch.serve.wlm.WorkerThread;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Stops workers without failing a request: each finishes the batch it holds and then leaves.
 *
 * <p>Why: TorchServe 0.12 stops a worker on scale-down or unregister by interrupting its thread
 * ({@code WorkerThread.shutdown}). A worker interrupted while its batch runs answers that batch
 * with 500 "Worker died."; one interrupted while it collects a batch (between taking the first
 * request and the batch delay) drops the requests it took, which are never answered
 * ({@code BatchAggregator.cleanJobs} in {@code WorkerThread.run}'s finally block).
 *
 * <p>How: the worker is told to stop after its current batch (its {@code running} flag) and marked
 * scaled down (so that TorchServe does not restart it). A worker waiting idle for work is woken by
 * a describe call. Once every worker has left its loop, TorchServe's own scale-down or unregister
 * finds nothing to interrupt.
 */
final class Drain {
    private static final Logger logger = LoggerFactory.getLogger(Drain.class);
    private static final long POLL_MS = 5;

    private Drain() {}

    /** Returns true when every worker left in time; false after ``timeoutMs`` (then TorchServe stops the rest). */
    static boolean stop(Model model, AdmissionQueue queue, List<WorkerThread> workers, long timeoutMs)
            throws InterruptedException {
        for (WorkerThread worker : workers) {
            worker.setState(WorkerState.WORKER_SCALED_DOWN, 200);
            Internals.stopAfterCurrentBatch(worker);
        }
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(timeoutMs);
        DescribeJob wake = null;
        while (!allExited(workers)) {
            if (System.nanoTime() > deadline) {
                logger.warn("{}: workers still busy after {} ms; stopping them anyway", queue.label, timeoutMs);
                return false;
            }
            // A worker idle on an empty queue takes no batch, so it never sees the flag: one
            // describe call at a time wakes whichever worker waits.
            if (queue.isEmpty() && (wake == null || wake.answer.isDone())) {
                wake = new DescribeJob(model.getModelName(), model.getVersion());
                queue.offer(wake);
            }
            Thread.sleep(POLL_MS);
        }
        return true;
    }

    private static boolean allExited(List<WorkerThread> workers) {
        for (WorkerThread worker : workers) {
            if (!Internals.hasExited(worker)) {
                return false;
            }
        }
        return true;
    }
}
