package org.torchrecserve.plugin;

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.LinkedBlockingDeque;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;
import org.pytorch.serve.job.Job;
import org.pytorch.serve.job.RestJob;
import org.pytorch.serve.util.messages.WorkerCommands;
import org.pytorch.serve.wlm.Model;

/**
 * A model's data queue that sheds load instead of letting it queue: TorchServe's workers take
 * their batches from here, and every inference request is offered here first.
 *
 * <p>The queue measures its workers: each worker's batch time (from taking a batch to coming back
 * for the next while requests wait) and the time per request in it, each the median of the last
 * {@link RecentTimes#SAMPLES} batches. A request arriving when {@code
 * n} requests wait would wait about {@code n x request time / ready workers} (or the batches of
 * the model's batch size those make, whichever is less: {@link #predictedWaitNs}); it is answered
 * at once with a 503 when that exceeds the target, so that accepted requests wait about one target at
 * most. The target is {@code guard.max_queue_wait_ms}, or four batch times (at least 100 ms:
 * a closed loop of 32 clients on an unbatched model, or a worker loading beside the others on a
 * small host, is not shed) when it is 0.
 *
 * <p>Also answered at once with a 503 naming the reason: a request when the queue holds {@code
 * jobQueueSize} requests (the memory bound), when the model has no ready worker (one stopped
 * answering and is being restarted), or while it is unregistered or scaled to 0. Other jobs
 * (describe calls) always queue. TorchServe's own answer to a full queue ("has no worker to serve
 * inference request") never happens: this queue takes every offer, answering those it sheds.
 */
final class AdmissionQueue extends LinkedBlockingDeque<Job> {
    private static final long serialVersionUID = 1L;
    private static final long MIN_TARGET_NS = TimeUnit.MILLISECONDS.toNanos(100);
    private static final long MIN_HANG_NS = TimeUnit.MILLISECONDS.toNanos(2000);

    /** A worker's current batch: when it took the first request, and how many it took. */
    private static final class Batch {
        final long startNs;
        int requests;

        Batch(long startNs) {
            this.startNs = startNs;
        }
    }

    /**
     * The median of the last {@code SAMPLES} measurements. A batch that a pause of the machine held
     * for 200 ms leaves it where it was; an average weighting it by a fifth (as this queue kept
     * before) tripled the predicted wait of the requests that queued behind that pause, just as
     * the queue was longest, and shed them (the 503s of a 10-minute soak at a fraction of the
     * capacity). A lasting change moves it within half the window's batches.
     */
    private static final class RecentTimes {
        static final int SAMPLES = 15;
        private final double[] samples = new double[SAMPLES];
        private int count;
        private int next;

        synchronized double add(double sample) {
            samples[next] = sample;
            next = (next + 1) % SAMPLES;
            count = Math.min(count + 1, SAMPLES);
            double[] sorted = Arrays.copyOf(samples, count); // the filled ones: [0, count) until it wraps
            Arrays.sort(sorted);
            return sorted[count / 2];
        }
    }

    final Model model;
    final String label;
    volatile GuardSettings settings; // the archive's, or a register call's (Guard.queue)
    private final int capacity;
    private final Map<Thread, Batch> batches = new ConcurrentHashMap<>();
    private final RecentTimes batchTimes = new RecentTimes();
    private final RecentTimes requestTimes = new RecentTimes();
    private volatile double batchNs; // measured (RecentTimes); 0: not yet
    private volatile double requestNs;
    private volatile int readyWorkers = 1; // set by the Guard
    private final AtomicInteger idleWorkers = new AtomicInteger(); // waiting for a batch's first request
    private volatile String closedReason; // set while the model is being unregistered
    private volatile String unavailableReason; // set by the Guard while no worker is ready
    final AtomicLong shedOverloaded = new AtomicLong();
    final AtomicLong shedUnavailable = new AtomicLong();

    AdmissionQueue(Model model, int capacity, GuardSettings settings) {
        this.model = model;
        this.label = Guard.label(model);
        this.capacity = capacity;
        this.settings = settings;
    }

    @Override
    public boolean offer(Job job) {
        if (!Internals.isInference(job.getCmd())) {
            return super.offer(job);
        }
        if (refusedDescribe(job)) {
            return true;
        }
        String unavailable = closedReason;
        if (unavailable == null && unavailableReason != null) { // the Guard's last look; look again
            unavailable = unavailableReason = Guard.get().unavailable(model, this);
        }
        if (unavailable != null) {
            shedUnavailable.incrementAndGet();
            refuse(job, unavailable);
            return true;
        }
        String overload = overload();
        if (overload != null) {
            shedOverloaded.incrementAndGet();
            refuse(job, label + " is overloaded: " + overload + "; retry with backoff");
            return true;
        }
        return super.offer(GrpcStatusJob.of(job));
    }

    /**
     * A request that the queue this one replaced had accepted: checked as {@link #offer} checks
     * it, but not shed (it was admitted already).
     */
    void takeAccepted(Job job) {
        if (!refusedDescribe(job)) {
            offerLast(GrpcStatusJob.of(job));
        }
    }

    /** Refuses an inference request carrying the describe header; true if it did. */
    private boolean refusedDescribe(Job job) {
        if (job.getPayload().getHeaders().keySet().stream().noneMatch(DescribeJob.DESCRIBE_HEADER::equalsIgnoreCase)) {
            return false;
        }
        // the handler would answer it as a management describe call, for the whole batch
        refuse(job, 400, "describe: a header of the management API's calls, refused on inference requests");
        return true;
    }

    /** Why a request arriving now would wait too long, or null. */
    private String overload() {
        int waiting = size();
        if (waiting >= capacity) {
            return "its queue holds " + capacity + " requests (jobQueueSize)";
        }
        if (waiting < idleWorkers.get()) {
            return null; // a worker waits for it: no wait to predict (and a stale estimate heals)
        }
        long waitNs = predictedWaitNs(waiting);
        long targetNs = targetNs();
        if (waitNs <= targetNs) {
            return null;
        }
        return String.format(
                "a request now would wait about %.0f ms (%d queued, %.2f ms each on %d workers), over its %.0f ms target (%s)",
                waitNs / 1e6, waiting, requestNs / 1e6, readyWorkers, targetNs / 1e6,
                settings.maxQueueWaitMs() > 0 ? "max_queue_wait_ms" : "four batch times; set by max_queue_wait_ms");
    }

    /**
     * The wait of a request behind {@code waiting} others: the lesser of two estimates, by the
     * time per request and by whole batches of the model's batch size. They agree under a
     * steady load; after one slow batch of few requests (a pause in the worker) the per-request
     * time is inflated and the batch estimate keeps a short queue from being shed.
     */
    private long predictedWaitNs(int waiting) {
        int ahead = waiting + 1;
        int batchSize = Math.max(1, model.getBatchSize());
        double byRequest = ahead * requestNs;
        double byBatch = Math.ceil(ahead / (double) batchSize) * batchNs;
        return (long) (Math.min(byRequest, byBatch) / Math.max(1, readyWorkers));
    }

    @Override
    public Job poll(long timeout, TimeUnit unit) throws InterruptedException {
        Thread worker = Thread.currentThread();
        boolean batchStart = Internals.isBatchStart(timeout); // Model.pollBatch's first take
        if (batchStart) {
            Batch previous = batches.get(worker);
            if (previous != null && previous.requests > 0 && !isEmpty()) {
                // requests waited while this worker ran its last batch: all that time was work
                double elapsed = System.nanoTime() - previous.startNs;
                batchNs = batchTimes.add(elapsed);
                requestNs = requestTimes.add(elapsed / previous.requests);
            }
        }
        Job job;
        if (batchStart) {
            idleWorkers.incrementAndGet();
            try {
                job = super.poll(timeout, unit);
            } finally {
                idleWorkers.decrementAndGet();
            }
            batches.put(worker, new Batch(System.nanoTime()));
        } else {
            job = takeMore(timeout, unit);
        }
        if (job != null && Internals.isInference(job.getCmd())) {
            Batch current = batches.get(worker);
            if (current != null) {
                current.requests++;
            }
        }
        return job;
    }

    /**
     * A later take for the batch a worker fills. TorchServe interrupts the worker's thread when its
     * process dies (or is scaled down): thrown from here, the interrupt makes {@code Model.pollBatch}
     * drop the requests already taken for the batch, answered by nobody, their clients waiting for
     * their own timeouts (one in three workers killed under load here). Instead the batch ends here
     * with the interrupt kept: the thread meets it as it sends the batch, and answers it as a dead
     * worker's ("Worker died.").
     */
    private Job takeMore(long timeout, TimeUnit unit) {
        try {
            return super.poll(timeout, unit);
        } catch (InterruptedException interrupted) {
            Thread.currentThread().interrupt();
            return null;
        }
    }

    @Override
    public int remainingCapacity() {
        return Math.max(0, capacity - size());
    }

    long targetNs() {
        if (settings.maxQueueWaitMs() > 0) {
            return TimeUnit.MILLISECONDS.toNanos(settings.maxQueueWaitMs());
        }
        return Math.max(MIN_TARGET_NS, (long) (4 * batchNs));
    }

    long hangAfterNs() {
        if (settings.hangAfterMs() > 0) {
            return TimeUnit.MILLISECONDS.toNanos(settings.hangAfterMs());
        }
        return Math.max(MIN_HANG_NS, (long) (20 * batchNs));
    }

    /** What the describe call shows of it. */
    Map<String, Object> describe() {
        Map<String, Object> state = new LinkedHashMap<>();
        state.put("queued", size());
        state.put("target_ms", targetNs() / 1e6);
        state.put("batch_ms", batchNs / 1e6);
        state.put("request_ms", requestNs / 1e6);
        state.put("hang_after_ms", hangAfterNs() / 1e6);
        state.put("shed_overloaded", shedOverloaded.get());
        state.put("shed_unavailable", shedUnavailable.get());
        return state;
    }

    void setReadyWorkers(int ready) {
        readyWorkers = ready;
    }

    void setUnavailable(String reason) {
        unavailableReason = reason;
    }

    /** New inference requests are refused with ``reason`` until ``open()``. */
    void close(String reason) {
        closedReason = reason;
    }

    void open() {
        closedReason = null;
    }

    boolean hasInferenceJobs() {
        for (Job job : this) {
            if (Internals.isInference(job.getCmd())) {
                return true;
            }
        }
        return false;
    }

    /** Answers every inference job still queued with a 503 giving ``reason``. */
    void refuseQueued(String reason) {
        List<Job> left = new ArrayList<>();
        drainTo(left);
        for (Job job : left) {
            if (Internals.isInference(job.getCmd())) {
                refuse(job, reason);
            }
        }
    }

    /** A 503 with our message: a JSON body with Retry-After on REST, UNAVAILABLE on gRPC. */
    static void refuse(Job job, String message) {
        refuse(job, 503, message);
    }

    /** {@code status} (400 or 503) with our message, as JSON on REST. */
    static void refuse(Job job, int status, String message) {
        if (job instanceof RestJob && job.getCmd() == WorkerCommands.PREDICT) {
            Map<String, Object> body = new LinkedHashMap<>();
            body.put("code", status);
            body.put("type", status == 503 ? "ServiceUnavailable" : "BadRequest");
            body.put("message", message);
            byte[] json = Replies.COMPACT.toJson(body).getBytes(StandardCharsets.UTF_8);
            job.response(json, "application/json", status, null, status == 503 ? Map.of("Retry-After", "1") : Map.of());
        } else {
            job.sendError(status, message);
        }
    }
}
