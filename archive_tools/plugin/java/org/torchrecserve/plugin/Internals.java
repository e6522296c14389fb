package org.torchrecserve.plugin;

import io.grpc.stub.ServerCallStreamObserver;
import io.grpc.stub.StreamObserver;
import java.lang.reflect.Field;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentMap;
import java.util.concurrent.LinkedBlockingDeque;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicReference;
import org.pytorch.serve.job.GRPCJob;
import org.pytorch.serve.job.Job;
import org.pytorch.serve.util.GRPCUtils;
import org.pytorch.serve.util.messages.BaseModelRequest;
import org.pytorch.serve.util.messages.WorkerCommands;
import org.pytorch.serve.wlm.BatchAggregator;
import org.pytorch.serve.wlm.Model;
import org.pytorch.serve.wlm.WorkerThread;

/**
 * The TorchServe 0.12 internals this plugin reads and steers, all in one place, each looked up
 * when the plugin loads ({@link Contract#require}: a TorchServe without them stops at start, naming
 * the one missing). TorchServe offers no public way to do any of this.
 *
 * <ul>
 *   <li>{@code Model.jobsDb}: the model's queues; its data queue is replaced by an {@link
 *       AdmissionQueue}.
 *   <li>{@code WorkerThread.req}: the batch a worker is running (null when idle).
 *   <li>{@code WorkerThread.aggregator.jobs}: the jobs of that batch, by request id.
 *   <li>{@code WorkerThread.running}: cleared so that a worker leaves after its current batch.
 *   <li>{@code WorkerThread.currentThread}: null once the worker's thread has ended.
 *   <li>{@code Model.pollBatch} takes a batch's first job with {@code poll(Long.MAX_VALUE, ms)} and
 *       the rest with {@code poll(maxBatchDelay)}: the only sign that a batch starts ({@link
 *       #isBatchStart}; pinned by a test that reads the compiled {@code Model.pollBatch}).
 *   <li>{@code GRPCJob.predictionResponseObserver}, {@code GRPCJob.modelInferResponseObserver}: a
 *       gRPC inference call, ended with the handler's message alone ({@link #failGrpcCall}).
 * </ul>
 */
final class Internals {
    private static final Field JOBS_DB = field(Model.class, "jobsDb");
    private static final Field WORKER_REQUEST = field(WorkerThread.class, "req");
    private static final Field WORKER_AGGREGATOR = field(WorkerThread.class, "aggregator");
    private static final Field WORKER_RUNNING = field(WorkerThread.class, "running");
    private static final Field WORKER_THREAD = field(WorkerThread.class, "currentThread");
    private static final Field AGGREGATOR_JOBS = field(BatchAggregator.class, "jobs");
    private static final Field GRPC_PREDICTIONS = field(GRPCJob.class, "predictionResponseObserver");
    private static final Field GRPC_MODEL_INFER = field(GRPCJob.class, "modelInferResponseObserver");

    /** {@code Model.DEFAULT_DATA_QUEUE}, a constant compiled into this plugin. */
    static final String DATA_QUEUE = Model.DEFAULT_DATA_QUEUE;

    private Internals() {}

    /** Loads this class: its fields are looked up, and a missing one fails here, by name. */
    static void check() {}

    /** Whether a poll of the data queue is a worker's first take of a new batch. */
    static boolean isBatchStart(long timeout) {
        return timeout == Long.MAX_VALUE;
    }

    /** The model's data queue: every inference request waits there for a worker. */
    static LinkedBlockingDeque<Job> dataQueue(Model model) {
        return queues(model).get(DATA_QUEUE);
    }

    static void setDataQueue(Model model, LinkedBlockingDeque<Job> queue) {
        queues(model).put(DATA_QUEUE, queue);
    }

    /** The inference batch the worker is running, or null (idle, loading, or describing). */
    static BaseModelRequest runningBatch(WorkerThread worker) {
        BaseModelRequest request = (BaseModelRequest) get(WORKER_REQUEST, worker);
        return request != null && isInference(request.getCommand()) ? request : null;
    }

    /** Removes and returns the jobs of the worker's running batch, so that nobody else answers them. */
    static List<Job> takeRunningJobs(WorkerThread worker) {
        BatchAggregator aggregator = (BatchAggregator) get(WORKER_AGGREGATOR, worker);
        @SuppressWarnings("unchecked")
        Map<String, Job> jobs = (Map<String, Job>) get(AGGREGATOR_JOBS, aggregator);
        List<Job> taken = new ArrayList<>();
        for (String id : new ArrayList<>(jobs.keySet())) {
            Job job = jobs.remove(id);
            if (job != null) {
                taken.add(job);
            }
        }
        return taken;
    }

    /** The worker finishes the batch it holds, if any, and then leaves its loop. */
    static void stopAfterCurrentBatch(WorkerThread worker) {
        ((AtomicBoolean) get(WORKER_RUNNING, worker)).set(false);
    }

    /** True once the worker's thread has left its loop (its backend process is stopped then). */
    static boolean hasExited(WorkerThread worker) {
        return ((AtomicReference<?>) get(WORKER_THREAD, worker)).get() == null;
    }

    /**
     * Ends a gRPC inference call ({@code Predictions}, {@code StreamPredictions}, {@code ModelInfer})
     * with TorchServe's gRPC code for {@code status} and {@code message} as the whole description:
     * {@code GRPCJob.sendError} appends the line {@code org.pytorch.serve.http.InternalServerException}
     * to it. A streamed call ({@code StreamPredictions2}, whose error is a message of the stream) goes
     * to {@code sendError}; a call its client cancelled is left alone, as {@code sendError} leaves it.
     */
    static void failGrpcCall(GRPCJob job, int status, String message) {
        WorkerCommands command = job.getCmd();
        Field field = command == WorkerCommands.OIPPREDICT ? GRPC_MODEL_INFER : GRPC_PREDICTIONS;
        StreamObserver<?> observer = (StreamObserver<?>) get(field, job);
        if (command == WorkerCommands.STREAMPREDICT2 || observer == null) {
            job.sendError(status, message);
        } else if (!(observer instanceof ServerCallStreamObserver
                && ((ServerCallStreamObserver<?>) observer).isCancelled())) {
            observer.onError(GRPCUtils.getGRPCStatusCode(status).withDescription(message).asRuntimeException());
        }
    }

    static boolean isInference(WorkerCommands command) {
        return command == WorkerCommands.PREDICT
                || command == WorkerCommands.OIPPREDICT
                || command == WorkerCommands.STREAMPREDICT
                || command == WorkerCommands.STREAMPREDICT2;
    }

    @SuppressWarnings("unchecked")
    private static ConcurrentMap<String, LinkedBlockingDeque<Job>> queues(Model model) {
        return (ConcurrentMap<String, LinkedBlockingDeque<Job>>) get(JOBS_DB, model);
    }

    private static Field field(Class<?> owner, String name) {
        try {
            Field field = owner.getDeclaredField(name);
            field.setAccessible(true);
            return field;
        } catch (NoSuchFieldException e) {
            throw new IllegalStateException(
                    "torchrec-serve plugin: TorchServe's "
                            + owner.getSimpleName()
                            + "."
                            + name
                            + " is missing; this plugin is built for TorchServe 0.12",
                    e);
        }
    }

    private static Object get(Field field, Object owner) {
        try {
            return field.get(owner);
        } catch (IllegalAccessException e) {
            throw new IllegalStateException(e);
        }
    }
}
